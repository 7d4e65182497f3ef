"""Planning (adaptiveload/sched/plan.py): throughput formulas, the budget search, plan files, from_plan."""
import dataclasses
import itertools
import json

import numpy as np
import pytest

from adaptiveload.sched import (Calibration, DualConstraintBucketSampler, Manifest, PackingSampler, Plan, make_plan,
                                reference_mix)
from adaptiveload.sched.cost_model import QuadraticCostModel
from adaptiveload.sched.metrics import composition
from adaptiveload.sched.plan import (PACKED_BUDGETS, PACKED_TIE, batch_mix, packed_throughput, predicted_throughput,
                                     rule_batch_sizes)
from adaptiveload.sched.presets import load_calibration

COST = QuadraticCostModel(18.75e-3, 7.16e-6, 3.957e-10)
GIB = 2**30


def _expand(seq, counts, b):
    """Every batch of an epoch as (tokens, cost), one list entry per batch."""
    out = []
    for s, n, bs in zip(seq, counts, b):
        for start in range(0, n, bs):
            size = min(bs, n - start)
            out.append((size * s, float(COST.predict(size, s))))
    return out


def test_batch_mix_counts_full_and_partial_batches():
    bucket, size, mult = batch_mix(np.array([10, 4, 7]), np.array([3, 4, 0]))
    assert sorted(zip(bucket.tolist(), size.tolist(), mult.tolist())) == [(0, 1, 1), (0, 3, 3), (1, 4, 1)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_random_policy_expectation_matches_enumeration(world):
    seq, counts, b = np.array([1560, 32760, 75600]), np.array([7, 5, 3]), np.array([20, 2, 1])
    batches = _expand(seq, counts, b)
    # independent draws: enumerate every W-tuple of batches (uniform over batches)
    maxima = [max(c for _, c in combo) for combo in itertools.product(batches, repeat=world)]
    tokens = np.mean([t for t, _ in batches]) * world
    got = predicted_throughput(COST, seq, counts, b, world, "random")
    assert got["step_time_s"] == pytest.approx(np.mean(maxima), rel=1e-12)
    assert got["tokens_per_s"] == pytest.approx(tokens / np.mean(maxima), rel=1e-12)


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_cost_grouped_matches_explicit_grouping(world):
    seq, counts, b = np.array([1560, 4680, 32760, 75600]), np.array([50, 31, 9, 4]), np.array([20, 6, 2, 1])
    batches = sorted(_expand(seq, counts, b), key=lambda x: x[1])
    groups = [batches[i:i + world] for i in range(0, len(batches), world)]
    step_sum = sum(max(c for _, c in g) for g in groups)
    got = predicted_throughput(COST, seq, counts, b, world, "cost_grouped")
    assert got["tokens_per_s"] == pytest.approx(sum(t for t, _ in batches) / step_sum, rel=1e-12)
    assert got["step_time_s"] == pytest.approx(step_sum / len(groups), rel=1e-12)


def _calibration(cost=COST):
    return Calibration([], cost, None, {}, "test")


def test_search_beats_every_budget_on_a_fine_grid():
    m = reference_mix(20_000, seed=1)
    plan = make_plan(m, _calibration(), 8, m_mem=151200)
    seq = np.array([r["seq_len"] for r in plan.buckets])
    counts = np.array([r["num_samples"] for r in plan.buckets])
    best = plan.predicted["tokens_per_s"]
    for budget in [*np.geomspace(0.05, 10.0, 400), None]:
        b = rule_batch_sizes(COST, seq, 151200, budget)
        assert predicted_throughput(COST, seq, counts, b, 8, "random")["tokens_per_s"] <= best * (1 + 1e-9)
    assert plan.predicted["speedup"] > 1.2  # the reference mix at W = 8 (benchmarks/results/simulate_reference_mix.md)
    assert plan.predicted["equal_token_idle"] == pytest.approx(0.37, abs=0.03)
    # table rows follow the rule
    assert [r["batch_size"] for r in plan.buckets] == rule_batch_sizes(COST, seq, plan.m_mem, plan.step_budget_s).tolist()
    assert [r["equal_token_batch_size"] for r in plan.buckets] == (151200 // seq).tolist()
    assert sum(r["share_of_steps"] for r in plan.buckets) == pytest.approx(1.0)


def test_memory_limit_from_memory_model_and_oversized():
    m = Manifest.from_pixels([1, 81, 81, 81], [480, 480, 720, 720], [832, 832, 1280, 1280])
    cal = load_calibration("anchors-wan1.3b")
    with pytest.raises(ValueError, match=r"\(memory model at 48.0 GiB x 0.9\): latent \(21, 90, 160\) S=75,600 "
                                         r"\(2 samples\).*--drop-oversized"):
        make_plan(m, cal, 2, memory_budget_bytes=48 * GIB)  # ~37k tokens fit: the 720p clips do not
    plan = make_plan(m, cal, 2, memory_budget_bytes=48 * GIB, drop_oversized=True)
    assert plan.dropped == [{"key": [21, 90, 160], "seq_len": 75600, "num_samples": 2}]
    assert plan.m_mem_limit == cal.memory_model.max_tokens(48 * GIB, safety=0.9)
    sampler = DualConstraintBucketSampler.from_plan(plan, m.latent_shapes, num_replicas=2, rank=0)
    assert sorted(i for r in range(2) for batch in DualConstraintBucketSampler.from_plan(
        plan, m.latent_shapes, num_replicas=2, rank=r) for i in batch) == [0, 1]
    assert sampler.dropped_buckets.size == 1
    # without a budget: the device memory the calibration records (the H200's 143,771 MiB) ...
    plan = make_plan(Manifest.from_seq_lens([1560, 9360]), cal, 1)
    assert plan.m_mem_limit == cal.memory_model.max_tokens(143771 * 2**20, safety=0.9)
    # ... or, when it records none, the largest B*S the calibration ran
    no_device = dataclasses.replace(cal, settings={k: v for k, v in cal.settings.items() if k != "device_memory_bytes"})
    assert make_plan(Manifest.from_seq_lens([1560, 9360]), no_device, 1).m_mem_limit == 37440
    with pytest.raises(ValueError, match="no memory limit"):
        make_plan(Manifest.from_seq_lens([1560]), _calibration(), 1)


def test_plan_file_round_trip_and_from_plan(tmp_path):
    m = reference_mix(5000, seed=3)
    plan = make_plan(m, _calibration(), 4, m_mem=151200, policy="cost_grouped")
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.to_json() == json.loads(json.dumps(plan.to_json()))
    sampler = DualConstraintBucketSampler.from_plan(back, m.latent_shapes, num_replicas=4, rank=1)
    assert sampler.policy == "cost_grouped"
    table = {tuple(r["key"]): r["batch_size"] for r in plan.buckets}
    assert {tuple(k): int(b) for k, b in zip(sampler.bucket_keys.tolist(), sampler.bucket_batch_sizes)} == table
    text = plan.format_table()
    assert "eq-tok B" in text and "speedup" in text
    with pytest.raises(FileNotFoundError):
        Plan.load(tmp_path / "none.json")
    path.write_text('{"format": "adaptiveload.plan", "version": 1}')
    with pytest.raises(ValueError, match="missing field 'world_size'"):
        Plan.load(path)


def test_bad_arguments():
    m = Manifest.from_seq_lens([100, 200])
    with pytest.raises(ValueError, match="Invalid world_size 0"):
        make_plan(m, _calibration(), 0, m_mem=1000)
    with pytest.raises(ValueError, match="unknown policy 'greedy'; choose one of equal_token, dual, cost_grouped, packed"):
        make_plan(m, _calibration(), 1, m_mem=1000, policy="greedy")
    with pytest.raises(ValueError, match=r"every bucket .* limit of 50 tokens \(given; shortest S = 100\)"):
        make_plan(m, _calibration(), 1, m_mem=50, drop_oversized=True)


def test_equal_token_policy_plans_the_equal_token_rule():
    m = reference_mix(5000, seed=3)
    plan = make_plan(m, _calibration(), 8, m_mem=151200, policy="equal_token")
    seq = np.array([r["seq_len"] for r in plan.buckets])
    counts = np.array([r["num_samples"] for r in plan.buckets])
    assert (plan.policy, plan.m_mem, plan.step_budget_s) == ("equal_token", 151200, None)
    assert [r["batch_size"] for r in plan.buckets] == (151200 // seq).tolist()
    assert [r["batch_size"] for r in plan.buckets] == [r["equal_token_batch_size"] for r in plan.buckets]
    expected = predicted_throughput(COST, seq, counts, 151200 // seq, 8, "random")
    assert plan.predicted["tokens_per_s"] == expected["tokens_per_s"] and plan.predicted["speedup"] == 1.0
    sampler = DualConstraintBucketSampler.from_plan(plan, m.latent_shapes, num_replicas=8, rank=0)
    assert sampler.policy == "random" and sampler.bucket_batch_sizes.tolist() == (151200 // sampler.bucket_seq_lens).tolist()


@pytest.mark.parametrize("old, new, order", [("random", "dual", "random"), ("cost_grouped", "cost_grouped", "cost_grouped"),
                                             ("dual-constraint", "dual", "random"),
                                             ("cost-grouped", "cost_grouped", "cost_grouped")])
def test_old_policy_names_in_make_plan_and_plan_files(old, new, order, tmp_path):
    m = reference_mix(3000, seed=4)
    plan = make_plan(m, _calibration(), 4, m_mem=151200, policy=old)
    assert plan.policy == new
    assert plan.buckets == make_plan(m, _calibration(), 4, m_mem=151200, policy=new).buckets
    # a plan file written before the rename (policy "random" or "cost_grouped") loads with the current name
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**plan.to_json(), "policy": old}))
    back = Plan.load(path)
    assert back.policy == new
    assert DualConstraintBucketSampler.from_plan(back, m.latent_shapes, num_replicas=4, rank=0).policy == order
    path.write_text(json.dumps({**plan.to_json(), "policy": "greedy"}))
    with pytest.raises(ValueError, match=r"old\.json: field 'policy': unknown policy 'greedy'"):
        Plan.load(path)


def test_packed_throughput_scores_the_steps_every_rank_trains():
    """Three samples too long to share a pack, on two ranks: two steps, the second with one rank padded.
    The score is that of the first step alone (tokens / its slowest rank), the composition that of both."""
    seq = np.array([600, 700, 800])
    score = packed_throughput(COST, seq, 1000, 0.05, 2)
    ep = PackingSampler(seq, 1000, 0.05, COST, num_replicas=2, rank=0).epoch_plan(0)
    full = (ep.step_packs >= 0).all(axis=1)
    assert full.tolist().count(True) == 1 and ep.num_steps == 2
    first = seq[[i for r in range(2) for i in ep.indices(int(np.flatnonzero(full)[0]), r)]]
    times = COST.c0 + COST.per_sample(first)
    assert score["tokens_per_s"] == pytest.approx(first.sum() / times.max(), rel=1e-12)
    assert score["idle"] == pytest.approx(1 - times.mean() / times.max(), rel=1e-12)
    assert score["composition_ks"] == pytest.approx(composition(*ep.step_samples(), seq)[0], rel=1e-12)


def test_packed_plan_budget_rows_and_prediction():
    """Policy packed: M_mem is the memory limit, the step budget the search's, the rows give each
    bucket's per-sample time and share of the work, and the prediction is the packer's own epoch."""
    m = reference_mix(20_000, seed=2)
    plan = make_plan(m, _calibration(), 8, m_mem=151200, policy="packed")
    assert (plan.policy, plan.m_mem, plan.m_mem_limit) == ("packed", 151200, 151200)
    seq = np.array([r["seq_len"] for r in plan.buckets])
    counts = np.array([r["num_samples"] for r in plan.buckets])
    assert [r["sample_time_s"] for r in plan.buckets] == pytest.approx((COST.c1 * seq + COST.c2 * seq**2).tolist())
    work = counts * (COST.c1 * seq + COST.c2 * seq**2)
    assert [r["share_of_work"] for r in plan.buckets] == pytest.approx((work / work.sum()).tolist())
    assert "batch_size" not in plan.buckets[0] and [r["equal_token_batch_size"] for r in plan.buckets] == (151200 // seq).tolist()
    # the prediction is the packing of this corpus (under PACKED_PLAN_SAMPLES samples) at the chosen budget
    again = packed_throughput(COST, m.latent_shapes, 151200, plan.step_budget_s, 8)
    assert plan.predicted["tokens_per_s"] == pytest.approx(again["tokens_per_s"], rel=1e-12)
    assert plan.predicted["idle"] < 0.03 and plan.predicted["speedup"] > 1.4
    # no candidate budget of the search predicts more than 1% more tokens/s
    longest, full = COST.per_sample(seq.max()), 151200 * work.sum() / (counts * seq).sum()
    for budget in COST.c0 + np.geomspace(0.6 * min(longest, full), 1.2 * max(longest, full), PACKED_BUDGETS):
        assert packed_throughput(COST, m.latent_shapes, 151200, float(budget), 8)["tokens_per_s"] <= \
            plan.predicted["tokens_per_s"] / (1 - PACKED_TIE) * (1 + 1e-12)
    text = plan.format_table()
    assert "policy packed" in text and "sample ms" in text and "work %" in text


def test_plan_records_units_and_memory_source(tmp_path):
    cal = load_calibration("anchors-wan1.3b")
    ltx = Manifest.from_pixels([1, 81], [480, 480], [832, 832], vae_stride=(8, 32, 32), patch_size=(1, 1, 1))
    plan = make_plan(ltx, cal, 1, policy="equal_token")
    assert (plan.vae_stride, plan.patch_size) == ((8, 32, 32), (1, 1, 1))
    assert [r["seq_len"] for r in plan.buckets] == [15 * 26, 11 * 15 * 26]  # (81 - 1) // 8 + 1 = 11 latent frames
    # the memory budget: the calibration's device, a given budget, or the peak a given m_mem needs
    device = 143771 * 2**20
    assert (plan.memory_source, plan.memory_budget_gib) == ("device", pytest.approx(device / GIB))
    given = make_plan(ltx, cal, 1, memory_budget_bytes=48 * GIB)
    assert (given.memory_source, given.memory_budget_gib) == ("memory_budget", pytest.approx(48.0))
    tokens = make_plan(ltx, cal, 1, m_mem=100_000)
    peak = cal.memory_model.m0 + cal.memory_model.m1 * 100_000
    assert (tokens.memory_source, tokens.memory_budget_gib) == ("m_mem", pytest.approx(peak / 0.9 / GIB))
    no_device = dataclasses.replace(cal, settings={})
    assert make_plan(ltx, no_device, 1).memory_source == "largest_batch"
    assert make_plan(ltx, no_device, 1).memory_budget_gib is None
    # saved and loaded; a plan file from before these fields loads with Wan's VAE stride
    path = tmp_path / "plan.json"
    tokens.save(path)
    back = Plan.load(path)
    assert (back.vae_stride, back.memory_source, back.memory_budget_gib) == ((8, 32, 32), "m_mem", tokens.memory_budget_gib)
    old = {k: v for k, v in tokens.to_json().items() if k not in ("vae_stride", "memory_source", "memory_budget_gib")}
    path.write_text(json.dumps(old))
    back = Plan.load(path)
    assert (back.vae_stride, back.memory_source, back.memory_budget_gib) == ((4, 8, 8), "", None)
