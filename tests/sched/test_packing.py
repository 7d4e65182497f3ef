"""PackingSampler and collate_packed (adaptiveload/sched/packing.py): coverage, equal steps, budgets,
balance, identical plans on every rank, padding, resume through DataLoader workers, errors."""
import logging

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.sched import (Calibration, DualConstraintBucketSampler, PackedBatch, PackingSampler, collate_packed,
                                make_plan, reference_mix, sampler_from_plan)
from adaptiveload.sched.cost_model import QuadraticCostModel
from adaptiveload.sched.packing import GROUP_PACKS, _cut_groups, _lpt
from adaptiveload.sched.policies import step_order

COST = QuadraticCostModel(18.75e-3, 7.16e-6, 3.957e-10)


def _ranks(seq, world, *args, **kw):
    return [PackingSampler(seq, *args, num_replicas=world, rank=r, **kw) for r in range(world)]


@given(st.lists(st.integers(1, 4000), min_size=1, max_size=250), st.integers(1, 5), st.floats(0.2, 6.0),
       st.floats(1.0, 4.0), st.integers(0, 3), st.integers(0, 2))
def test_packing_properties(seq, world, budget_factor, room_factor, seed, epoch):
    """Every rank builds the same plan and runs the same number of steps; every sample is trained once;
    no pack holds more than m_mem tokens; only the last step pads, with the shortest sample at weight 0."""
    seq = np.array(seq)
    m_mem = int(seq.max() * room_factor)
    budget = COST.c0 + float(COST.per_sample(seq.max())) * budget_factor
    samplers = _ranks(seq, world, m_mem, budget, COST, seed=seed)
    for smp in samplers:
        smp.set_epoch(epoch)
    plans = [smp.epoch_plan() for smp in samplers]
    for other in plans[1:]:
        np.testing.assert_array_equal(other.step_packs, plans[0].step_packs)
        np.testing.assert_array_equal(other.order, plans[0].order)
    yielded = [list(smp) for smp in samplers]
    steps = len(yielded[0])
    assert all(len(y) == steps == len(smp) for y, smp in zip(yielded, samplers))
    shortest = int(np.flatnonzero(seq == seq.min())[0])
    counts = np.zeros(len(seq), dtype=int)
    padded_steps = set()
    for r, (smp, packs) in enumerate(zip(samplers, yielded)):
        for step, pack in enumerate(packs):
            if smp.loss_weight(step) == 0.0:
                assert pack == [shortest]
                padded_steps.add(step)
                continue
            assert smp.loss_weight(step) == 1.0 and len(pack) >= 1
            assert seq[pack].sum() <= m_mem
            np.add.at(counts, pack, 1)
    assert counts.tolist() == [1] * len(seq)
    assert len(padded_steps) <= 1  # only one step has ranks without a pack
    padding = sum(smp.loss_weight(s) == 0.0 for smp in samplers for s in range(steps))
    assert padding == steps * world - plans[0].pack_size.size < world
    np.testing.assert_array_equal(plans[0].sample_counts(len(seq)), counts)


@given(st.integers(0, 2**32 - 1), st.integers(2000, 4000), st.integers(1, 64), st.sampled_from([1, 2, 8, 16]))
def test_packs_are_balanced_on_random_corpora(seed, n, spread, world):
    """With memory to spare, LPT leaves every pack of a group within one sample's work of the others
    (the pack that ends highest was the least loaded when it took its last sample), and the groups hold
    equal work to within a fine sample over 32 packs: every step's packs differ by at most about the
    largest sample's work."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(100, 100 + 100 * spread, n)
    work = COST.per_sample(seq)
    budget = COST.c0 + 8 * float(work.max())
    ep = PackingSampler(seq, int(seq.sum()), budget, COST, num_replicas=world, rank=0, seed=seed).epoch_plan(0)
    times = ep.step_costs(COST)[(ep.step_packs >= 0).all(axis=1)]
    assert times.size
    assert (times.max(axis=1) - times.min(axis=1) <= 1.1 * work.max()).all()
    # the packs are near the budget: the number of packs is the corpus's work over the budget
    assert ep.pack_size.size == pytest.approx(work.sum() / (budget - COST.c0), rel=0.05, abs=GROUP_PACKS)


def _reference_lpt(group, seq, work, m_mem):
    """LPT by hand, one sample at a time: the least-loaded pack of its group with room for it (the
    lowest index among equals), -1 when none has room."""
    loads, tokens, slots = {}, {}, []
    for g, s, w in zip(group.tolist(), seq.tolist(), work.tolist()):
        load = loads.setdefault(g, [0.0] * GROUP_PACKS)
        tok = tokens.setdefault(g, [0] * GROUP_PACKS)
        room = [p for p in range(GROUP_PACKS) if tok[p] + s <= m_mem]
        if not room:
            slots.append(-1)
            continue
        p = min(room, key=lambda q: (load[q], q))
        load[p] += w
        tok[p] += s
        slots.append(p)
    return np.array(slots)


@given(st.lists(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), max_size=90), min_size=1, max_size=5),
       st.integers(60, 400))
def test_vectorised_lpt_matches_lpt_by_hand(groups, m_mem):
    """Integer work keeps the float32 loads exact, so every choice must be the reference's."""
    rows = [(g, s, w) for g, items in enumerate(groups) for s, w in sorted(items, key=lambda x: -x[1])]
    if not rows:
        return
    group, seq, work = (np.array(col) for col in zip(*rows))
    got = _lpt(group, seq, work.astype(np.float64), len(groups), m_mem, int(seq.min()))
    np.testing.assert_array_equal(got, _reference_lpt(group, seq, work, m_mem))


def test_groups_hold_equal_work():
    """Each group's work is the total over the number of groups, to within half a fine sample (the fine
    stream tops up what the coarse one left), and each stream keeps its random order across groups."""
    work = COST.per_sample(reference_mix(50_000, seed=5).seq_lens)
    fine_work = float(np.median(work))
    group, num_groups = _cut_groups(work, fine_work, 32 * 3.0, 1.0, 10**9)
    assert num_groups == round(work.sum() / (32 * 3.0))
    totals = np.bincount(group, weights=work, minlength=num_groups)
    cumulative = np.cumsum(totals) - np.arange(1, num_groups + 1) * work.sum() / num_groups
    assert np.abs(cumulative).max() <= fine_work / 2 + 1e-9
    for stream in (work <= fine_work, work > fine_work):
        assert (np.diff(group[stream]) >= 0).all()


def test_reference_mix_balance_and_coverage():
    m = reference_mix(60_000, seed=1)
    smp = PackingSampler(m.latent_shapes, 151200, 2.85, COST, num_replicas=8, rank=3)
    ep = smp.epoch_plan(0)
    costs = ep.step_costs(COST)
    full = costs[(ep.step_packs >= 0).all(axis=1)]
    assert np.mean(full.std(axis=1) / full.mean(axis=1)) < 0.02
    assert np.mean(1 - full.mean(axis=1) / full.max(axis=1)) < 0.02
    assert ep.sample_counts(len(m)).tolist() == [1] * len(m)
    assert ep.step_tokens().max() <= 151200
    # tokens per rank and step are the sums of the packs' sequence lengths
    step, rank = 5, 2
    assert ep.step_tokens()[step, rank] == m.seq_lens[ep.indices(step, rank)].sum()
    assert costs[step, rank] == pytest.approx(COST.c0 + COST.per_sample(m.seq_lens[ep.indices(step, rank)]).sum())
    # another epoch is another order; the same epoch the same
    assert not np.array_equal(smp.epoch_plan(1).order, ep.order)
    np.testing.assert_array_equal(PackingSampler(m.latent_shapes, 151200, 2.85, COST, num_replicas=8,
                                                 rank=0).epoch_plan(0).step_packs, ep.step_packs)


def test_oversized_samples_are_named_or_dropped(caplog):
    seq = np.array([100, 5000, 100, 7000, 300])
    with pytest.raises(ValueError, match=r"2 sample\(s\) longer than m_mem=1,000 tokens per pack: sample 1 "
                                         r"\(S=5,000\), sample 3 \(S=7,000\); raise the memory budget"):
        PackingSampler(seq, 1000, 0.5, COST)
    with caplog.at_level(logging.WARNING, logger="adaptiveload.sched"):
        smp = PackingSampler(seq, 1000, 0.5, COST, drop_oversized=True)
    assert "dropping 2 sample(s) longer than m_mem=1,000 tokens: sample 1 (S=5,000), sample 3 (S=7,000)" in caplog.text
    assert smp.dropped_samples.tolist() == [1, 3]
    assert sorted(i for pack in smp for i in pack) == [0, 2, 4]
    with pytest.raises(ValueError, match="every sample is longer than m_mem=50"):
        PackingSampler(seq, 50, 0.5, COST, drop_oversized=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"m_mem": 0}, "Invalid m_mem 0"),
    ({"m_mem": 10.5}, "Invalid m_mem 10.5"),
    ({"step_budget_s": 0.0}, "Invalid step_budget_s 0.0"),
    ({"step_budget_s": float("nan")}, "Invalid step_budget_s nan"),
    ({"step_budget_s": 0.01}, r"Invalid step_budget_s 0.01: a step's fixed time alone is 0.01875 s"),
    ({"cost_model": "quadratic"}, "cost_model must be a CostModel, got str"),
    ({"rank": 3, "num_replicas": 2}, r"Invalid rank 3, rank should be in the interval \[0, 1\]"),
    ({"shapes_or_seq_lens": [5, 0, 3]}, r"got \[0\] at sample 1"),
])
def test_bad_arguments(kwargs, match):
    args = {"shapes_or_seq_lens": [10, 20, 30], "m_mem": 100, "step_budget_s": 1.0, "cost_model": COST, **kwargs}
    with pytest.raises(ValueError, match=match):
        PackingSampler(**args)


def test_loss_weight_marks_only_the_padding_packs():
    # 3 samples alone in their packs (each longer than half of m_mem) on 2 ranks: 2 steps, one padded rank
    seq = [600, 700, 800]
    samplers = _ranks(seq, 2, 1000, 0.05, COST)
    weights = [[smp.loss_weight(step) for step in range(len(smp))] for smp in samplers]
    assert sorted(w for ws in weights for w in ws) == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(IndexError, match="step 2 outside the epoch's 2 steps"):
        samplers[0].loss_weight(2)


class _Latents(torch.utils.data.Dataset):
    def __init__(self, shapes):
        self.shapes = shapes

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        return {"index": i, "latents": torch.zeros(4, *self.shapes[i].tolist())}


def test_a_state_resumes_only_the_same_packing():
    """Resume through DataLoader workers: tests/sched/test_sampler.py (shared with the bucket sampler)."""
    seq = reference_mix(2000, seed=4).seq_lens
    kw = dict(m_mem=151200, step_budget_s=2.85, cost_model=COST, num_replicas=2, rank=1, seed=11)
    state = PackingSampler(seq, **kw).state_dict(consumed_steps=5)
    assert (state["policy"], state["consumed_steps"]) == ("packed", 5)
    for change in ({"step_budget_s": 3.0}, {"m_mem": 150000}):
        with pytest.raises(ValueError, match="fingerprint mismatch"):
            PackingSampler(seq, **{**kw, **change}).load_state_dict(state)
    with pytest.raises(ValueError, match="num_replicas was 2, this sampler has 4"):
        PackingSampler(seq, **{**kw, "num_replicas": 4}).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        PackingSampler(seq[::-1].copy(), **kw).load_state_dict(state)
    resumed = PackingSampler(seq, **kw)
    resumed.load_state_dict(state)
    assert len(resumed) == len(PackingSampler(seq, **kw)) - 5


def test_collate_packed_through_a_dataloader():
    m = reference_mix(400, seed=2)
    smp = PackingSampler(m.latent_shapes, 151200, 2.85, COST, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(_Latents(m.latent_shapes), batch_sampler=smp, collate_fn=collate_packed)
    expected = [smp.epoch_plan(0).indices(step, 0) for step in range(len(smp))]
    packs = list(loader)
    assert len(packs) == len(expected)
    for pack, indices in zip(packs, expected):
        assert isinstance(pack, PackedBatch) and [item["index"] for item in pack.samples] == indices
        seq = m.seq_lens[indices]
        assert pack.cu_seqlens.dtype == torch.int32 and pack.segment_ids.dtype == torch.int32
        assert pack.cu_seqlens.tolist() == [0, *np.cumsum(seq).tolist()]
        assert pack.segment_ids.tolist() == np.repeat(np.arange(len(seq)), seq).tolist()
        assert pack.latent_shapes.tolist() == m.latent_shapes[indices].tolist() and pack.max_seqlen == seq.max()


def test_collate_packed_by_hand_and_errors():
    # CogVideoX-style 2x2x2 patches: 1, 2 and 4 tokens
    pack = collate_packed([torch.zeros(2, 2, 2, 2), torch.zeros(2, 2, 2, 4), torch.zeros(2, 4, 4, 2)], patch_size=(2, 2, 2))
    assert pack.cu_seqlens.tolist() == [0, 1, 3, 7] and pack.segment_ids.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert pack.latent_shapes.tolist() == [[2, 2, 2], [2, 2, 4], [4, 4, 2]] and pack.max_seqlen == 4 and len(pack) == 3
    with pytest.raises(ValueError, match="empty pack"):
        collate_packed([])
    with pytest.raises(ValueError, match=r"item 1 \(sample 9\) has no latents tensor \[C, T, H, W\]; got Tensor\[4, 4\]"):
        collate_packed([torch.zeros(1, 1, 2, 2), {"index": 9, "latents": torch.zeros(4, 4)}])
    with pytest.raises(ValueError, match=r"item 1 has latent shape \[1, 3, 2\], not a multiple of the patch size"):
        collate_packed([torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 3, 2)])


def test_from_plan_and_the_policy_vocabulary():
    m = reference_mix(4000, seed=3)
    cal = Calibration([], COST, None, {}, "test")
    plan = make_plan(m, cal, 4, m_mem=151200, policy="packed")
    smp = sampler_from_plan(plan, m.latent_shapes, num_replicas=4, rank=1, seed=2)
    assert isinstance(smp, PackingSampler)
    assert (smp.m_mem, smp.step_budget_s, smp.policy) == (151200, plan.step_budget_s, "packed")
    assert isinstance(sampler_from_plan(make_plan(m, cal, 4, m_mem=151200, policy="dual"), m.latent_shapes,
                                        num_replicas=4, rank=1), DualConstraintBucketSampler)
    with pytest.raises(ValueError, match="policy 'packed' has no bucket step order"):
        DualConstraintBucketSampler.from_plan(plan, m.latent_shapes, num_replicas=4, rank=0)
    with pytest.raises(ValueError, match="policy 'packed' has no bucket step order"):
        step_order("packed")
    with pytest.raises(ValueError, match="plan policy 'dual' is not 'packed'"):
        PackingSampler.from_plan(make_plan(m, cal, 4, m_mem=151200, policy="dual"), m.latent_shapes, num_replicas=4,
                                 rank=0)
