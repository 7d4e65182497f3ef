"""Per-bucket batch-size rules, vectorised over sequence lengths.

* equal-token (the usual video-trainer rule): ``B = max(1, floor(M_tok / S))``;
* dual-constraint (memory and compute): ``B = max(1, min(floor(M_mem / S), floor(M_comp / S^p)))``;
* the general form the sampler and the planner use: the largest ``B`` with ``B*S <= M_mem`` and a
  fitted cost model's predicted step time ``<= C_budget``
  (:meth:`adaptiveload.sched.cost_model.CostModel.max_batch_size`); for the power model
  ``t = a + b*B*S^p`` this is exactly ``B*S^p <= M_comp`` with ``M_comp = (C_budget - a) / b``.

The two paper rules return at least 1 even when one sample alone exceeds the budget (``S > M_mem``);
the sampler and :func:`adaptiveload.sched.plan.make_plan` refuse such buckets instead
(see :func:`oversized_buckets`).
"""
from __future__ import annotations

import numpy as np


def _as_seq_lens(seq_len) -> tuple[np.ndarray, bool]:
    s = np.asarray(seq_len)
    if not (np.issubdtype(s.dtype, np.integer) or np.issubdtype(s.dtype, np.floating)):
        raise ValueError(f"seq_len must be numbers of tokens, got dtype {s.dtype}")
    bad = np.flatnonzero(~(s.reshape(-1) >= 1))
    if bad.size:
        raise ValueError(f"seq_len must be >= 1 token, got {s.reshape(-1)[bad[0]]!r} at index {int(bad[0])}")
    return s.astype(np.int64), s.ndim == 0


def _check_positive(name: str, value) -> float:
    if value is None or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _result(b: np.ndarray, scalar: bool):
    return int(b) if scalar else b


def equal_token_batch_size(seq_len, m_tok):
    """Equal-token batch size ``max(1, floor(m_tok / S))``.

    Args:
        seq_len: int or int array [n], tokens per sample S (>= 1).
        m_tok: tokens per batch (> 0).

    Returns:
        ``int`` for a scalar ``seq_len``, else int64 array [n].

    Raises:
        ValueError: ``seq_len < 1`` or ``m_tok <= 0``.

    Example::

        >>> equal_token_batch_size([1560, 32760, 75600], 151200).tolist()
        [96, 4, 2]
    """
    s, scalar = _as_seq_lens(seq_len)
    m_tok = _check_positive("m_tok", m_tok)
    return _result(np.maximum(1, np.floor(m_tok / s)).astype(np.int64), scalar)


def dual_constraint_batch_size(seq_len, m_mem, m_comp, p):
    """Dual-constraint batch size ``max(1, min(floor(m_mem / S), floor(m_comp / S^p)))``.

    Args:
        seq_len: int or int array [n], tokens per sample S (>= 1).
        m_mem: memory budget in tokens per batch (``B*S <= m_mem``).
        m_comp: compute budget in units of ``S^p`` per batch (``B*S^p <= m_comp``).
        p: cost exponent (step time ~ ``B*S^p``); 1 turns the rule into equal-token, 2 into
            equal attention FLOPs.

    Returns:
        ``int`` for a scalar ``seq_len``, else int64 array [n].

    Raises:
        ValueError: ``seq_len < 1``, a non-positive budget, or ``p <= 0``.

    .. note::
        The rule of the dual-constraint bucketing paper; ``m_comp`` is usually set relative to the
        longest sequence, e.g. ``1.5 * S_max**p``.

    Example::

        >>> dual_constraint_batch_size([1560, 32760, 75600], 151200, 1.5 * 75600**1.41, 1.41).tolist()
        [96, 4, 1]
    """
    s, scalar = _as_seq_lens(seq_len)
    m_mem = _check_positive("m_mem", m_mem)
    m_comp = _check_positive("m_comp", m_comp)
    p = _check_positive("p", p)
    b = np.minimum(np.floor(m_mem / s), np.floor(m_comp / np.power(s.astype(np.float64), p)))
    return _result(np.maximum(1, b).astype(np.int64), scalar)


def oversized_buckets(seq_lens, m_mem) -> np.ndarray:
    """Indices of the entries of ``seq_lens`` (int array [k]) whose single sample exceeds ``m_mem`` tokens."""
    return np.flatnonzero(np.asarray(seq_lens, dtype=np.int64) > m_mem)
