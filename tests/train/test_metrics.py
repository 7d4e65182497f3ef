"""Busy time and load-balance statistics against hand-computed values."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from adaptiveload.train.metrics import _union_length, busy_time_s, load_balance, summarize


def test_load_balance_matches_hand_computation():
    busy = np.array([[1.0, 3.0], [2.0, 2.0]])
    stats = load_balance(busy)
    # step 1: mean 2, std 1 -> CV 0.5, idle 1 - 2/3; step 2: CV 0, idle 0
    assert stats["compute_load_cv"] == pytest.approx(0.25)
    assert stats["idle_fraction"] == pytest.approx((1 - 2 / 3) / 2)
    assert stats["profiled_steps"] == 2
    assert math.isnan(load_balance(np.zeros((0, 2)))["compute_load_cv"])


def test_merged_intervals():
    assert _union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert _union_length([]) == 0


def test_summarize():
    s = summarize([1, 2, 3, 4])
    assert s["median"] == 2.5 and s["min"] == 1 and s["max"] == 4 and s["mean"] == 2.5
    assert math.isnan(summarize([])["median"])


def test_cpu_busy_time_excludes_collectives(tmp_path):
    """A gloo all-reduce inside the profiled region is subtracted from the wall time."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                dist.all_reduce(torch.ones(1 << 16))
            torch.randn(256, 256) @ torch.randn(256, 256)
        events = [e for e in prof.events() if "all_reduce" in e.name or "allreduce" in e.name]
        assert events
        comm = _union_length([(e.time_range.start, e.time_range.end) for e in events]) / 1e6
        wall = 1.0
        assert busy_time_s(prof, torch.device("cpu"), wall) == pytest.approx(wall - comm, rel=1e-6, abs=1e-6)
        assert busy_time_s(prof, torch.device("cpu"), 1e-9) == 0.0
    finally:
        dist.destroy_process_group()
