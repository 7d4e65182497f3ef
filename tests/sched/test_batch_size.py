"""Batch-size rules (adaptiveload/sched/batch_size.py) against the direct formulas."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.sched import dual_constraint_batch_size, equal_token_batch_size


def _direct(s, m_mem, m_comp, p):
    return max(1, min(math.floor(m_mem / s), math.floor(m_comp / s**p)))


@given(st.lists(st.integers(1, 200_000), min_size=1, max_size=30), st.integers(1, 10**6),
       st.floats(1.0, 1e12), st.floats(1.0, 2.0))
def test_dual_constraint_matches_direct_formula(seq_lens, m_mem, m_comp, p):
    got = dual_constraint_batch_size(np.array(seq_lens), m_mem, m_comp, p)
    assert got.tolist() == [_direct(s, m_mem, m_comp, p) for s in seq_lens]


@given(st.integers(1, 200_000), st.integers(1, 10**6), st.floats(1.0, 1e12), st.floats(1.0, 2.0))
def test_dual_constraint_is_largest_feasible(s, m_mem, m_comp, p):
    b = dual_constraint_batch_size(s, m_mem, m_comp, p)
    assert isinstance(b, int) and b >= 1
    if b > 1:  # feasible under both budgets (relative slack for float rounding of S^p)
        assert b * s <= m_mem and b * s**p <= m_comp * (1 + 1e-12)
    # one more sample breaks one of the budgets
    assert (b + 1) * s > m_mem or (b + 1) * s**p > m_comp * (1 - 1e-12)


def test_extremes():
    assert dual_constraint_batch_size(1, 100, 1e9, 2.0) == 100  # S = 1: memory binds
    assert dual_constraint_batch_size(500, 100, 1e9, 2.0) == 1  # S > m_mem: the rule still says 1
    assert dual_constraint_batch_size(1000, 10**6, 4000, 1.0) == 4  # p = 1: B*S <= m_comp
    assert dual_constraint_batch_size(100, 10**6, 40_000, 2.0) == 4  # p = 2: B*S^2 <= m_comp
    assert equal_token_batch_size([1560, 32760, 75600], 151200).tolist() == [96, 4, 2]
    assert equal_token_batch_size(200_000, 151200) == 1


@pytest.mark.parametrize("kwargs, match", [({"m_mem": 0}, "m_mem"), ({"m_comp": -1.0}, "m_comp"), ({"p": 0.0}, "p must"),
                                           ({"seq_len": [10, 0]}, "seq_len")])
def test_bad_inputs(kwargs, match):
    args = {"seq_len": [10], "m_mem": 100, "m_comp": 1e4, "p": 1.5, **kwargs}
    with pytest.raises(ValueError, match=match):
        dual_constraint_batch_size(**args)
