"""Peak-memory model (adaptiveload/sched/memory_model.py)."""
import numpy as np
import pytest

from adaptiveload.sched import MemoryModel

GIB = 2**30


def test_linear_fit_and_max_tokens():
    b = np.array([16, 8, 4, 2, 1])
    s = np.array([1560, 4680, 9360, 18720, 32760])
    peak = 5 * GIB + 2**20 * b * s  # 5 GiB + 1 MiB per token, exactly
    m = MemoryModel.fit(b, s, peak)
    assert m.m2 == 0.0
    np.testing.assert_allclose([m.m0, m.m1], [5 * GIB, 2**20], rtol=1e-9)
    # 0.9 * 80 GiB - 5 GiB = 67 GiB of activations at 1 MiB/token = 68,608 tokens
    assert m.max_tokens(80 * GIB, safety=0.9) == 67 * 1024


def test_quadratic_term_only_when_demanded():
    b = np.array([1, 2, 4, 1, 2, 1, 8, 1])
    s = np.array([1000, 2000, 4000, 8000, 16000, 32000, 500, 64000])
    peak = 2 * GIB + 1e5 * b * s + 3.0 * b * s * s
    m = MemoryModel.fit(b, s, peak)
    assert m.m2 == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(ValueError, match="pass seq_len"):
        m.max_tokens(80 * GIB)
    t = m.max_tokens(80 * GIB, seq_len=64000)
    assert 2 * GIB + t * (1e5 + 3.0 * 64000) <= 0.9 * 80 * GIB < 2 * GIB + (t + 1) * (1e5 + 3.0 * 64000)


def test_errors():
    with pytest.raises(ValueError, match="at least 2"):
        MemoryModel.fit([1], [10], [100])
    with pytest.raises(ValueError, match=r"peak_bytes\[1\]"):
        MemoryModel.fit([1, 2], [10, 10], [100, -1])
    with pytest.raises(ValueError, match="leaves nothing"):
        MemoryModel(10 * GIB, 1.0).max_tokens(8 * GIB)
    with pytest.raises(ValueError, match="safety"):
        MemoryModel(0, 1.0).max_tokens(8 * GIB, safety=1.5)


def test_json_round_trip():
    m = MemoryModel(1e9, 1e6, 3.0, n_points=7, r2=0.99)
    back = MemoryModel.from_json(m.to_json())
    assert (back.m0, back.m1, back.m2, back.n_points, back.r2) == (1e9, 1e6, 3.0, 7, 0.99)
    with pytest.raises(ValueError, match="missing"):
        MemoryModel.from_json({"m0": 1})
