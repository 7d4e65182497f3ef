"""PackingSampler and collate_packed (adaptiveload/sched/packing.py): coverage, equal steps, budgets,
balance, identical plans on every rank, padding, resume through DataLoader workers, errors."""
import logging

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptiveload.sched import (Calibration, DualConstraintBucketSampler, PackedBatch, PackingSampler, collate_packed,
                                make_plan, reference_mix, sampler_from_plan)
from adaptiveload.sched.cost_model import QuadraticCostModel
from adaptiveload.sched.metrics import composition
from adaptiveload.sched.packing import GROUP_PACKS, LOAD_TOLERANCE, WATER_LEVEL_ROUNDS, _cut_groups, _lpt, _top_up
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


@settings(max_examples=12)
@given(st.integers(0, 2**32 - 1), st.sampled_from([16, 64, 256]), st.integers(151200, 302400), st.integers(0, 2))
@example(seed=0, world=64, m_mem=151200, epoch=0)
def test_steps_are_near_random_samples(seed, world, m_mem, epoch):
    """On the reference mix, with memory for two of its longest clips or more and the budget of the
    longest clip alone (the plan's choice there), nearly every pack reaches the same time -- 98% of them
    within the packer's band (LOAD_TOLERANCE, 2%) of the median (98.9-99.7% over 14 random draws; within
    1% it is 96-99% at 256 ranks, whose 161 steps an epoch round the pack count most coarsely), so the packs
    need no sorting by time and a step's samples are close to random ones: its KS against the corpus
    at most 1.75 times that of the same steps filled with the samples in random order. (A packer whose
    packs run out of tokens before the budget -- those without long clips -- must give them steps of
    their own: on this mix that was 2.5-5 times the random steps' KS.) At least 160 steps an epoch: the
    whole steps move the mean pack time by at most 1/320 of the budget, and the packs of the longest
    clip stay in the others' band."""
    m = reference_mix(200_000, seed=seed)
    budget = COST.c0 + float(COST.per_sample(m.seq_lens.max()))
    smp = PackingSampler(m.seq_lens, m_mem, budget, COST, num_replicas=world, rank=0, seed=seed)
    ep = smp.epoch_plan(epoch)
    times = ep.pack_times(COST)
    assert np.mean(np.abs(times / np.median(times) - 1) <= LOAD_TOLERANCE) >= 0.98
    step, sample = ep.step_samples()
    ks, _ = composition(step, sample, m.seq_lens)
    random_ks, _ = composition(step, np.random.default_rng(seed).permutation(sample), m.seq_lens)
    assert ks <= 1.75 * random_ks


def _water_level(work, packs):
    """A group's work per pack without the samples longer than that, each alone in a pack, found as
    the packer does in WATER_LEVEL_ROUNDS rounds."""
    level = sum(work) / packs
    for _ in range(WATER_LEVEL_ROUNDS):
        over = [w for w in work if w > level]
        if len(over) < packs:
            level = (sum(work) - sum(over)) / (packs - len(over))
    return level


def _reference_lpt(group, seq, work, group_packs, m_mem):
    """The packer's LPT by hand, one sample at a time: among the packs of its group with room for it
    below the group's water level B, the one with the most work left per token left (the lowest
    index among equals; the ratio rounded to float32 as the packer keeps it); else the least-loaded
    pack with room; -1 when none has room."""
    work_left, tokens_left, slots = {}, {}, []
    for g, s, w in zip(group.tolist(), seq.tolist(), work.tolist()):
        packs = int(group_packs[g])
        level = float(np.float32(_water_level(work[group == g].tolist(), packs)))
        left = work_left.setdefault(g, [level] * packs)
        tok = tokens_left.setdefault(g, [m_mem] * packs)
        room = [p for p in range(packs) if tok[p] >= s]
        under = [p for p in room if left[p] >= w]
        if under:
            p = max(under, key=lambda q: (np.float32(left[q] / max(tok[q], 1)), -q))
        elif room:
            p = max(room, key=lambda q: (left[q], -q))
        else:
            slots.append(-1)
            continue
        left[p] -= w
        tok[p] -= s
        slots.append(p)
    return np.array(slots)


@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), max_size=90),
                          st.integers(1, GROUP_PACKS)), min_size=1, max_size=5),
       st.integers(60, 400))
def test_vectorised_lpt_matches_lpt_by_hand(groups, m_mem):
    """Integer work keeps the float32 loads exact, so every choice must be the reference's; groups
    of any number of packs up to GROUP_PACKS."""
    rows = [(g, s, w) for g, (items, _) in enumerate(groups) for s, w in sorted(items, key=lambda x: -x[1])]
    if not rows:
        return
    group, seq, work = (np.array(col) for col in zip(*rows))
    group_packs = np.array([packs for _, packs in groups])
    got = _lpt(group, seq, work.astype(np.float64), group_packs, m_mem)
    expected = _reference_lpt(group, seq, work, group_packs, m_mem)
    np.testing.assert_array_equal(got, expected)
    assert (got < group_packs[group]).all()


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(0, 60), st.integers(5000, 9000))
def test_top_up_gives_the_longest_samples_the_roomiest_packs(seq, extra, m_mem):
    """The i-th longest waiting sample joins the pack with the i-th most room (first index among
    equals) where it fits; no pack takes two, none is pushed past m_mem, and -1 (no pack) is never chosen."""
    seq = np.array(seq)
    rng = np.random.default_rng(len(seq) + extra)
    room = np.concatenate([rng.integers(0, m_mem, seq.size + extra), [-1] * 3])
    pack = _top_up(room, seq)
    roomiest = sorted(range(room.size), key=lambda p: (-room[p], p))
    for rank, i in enumerate(sorted(range(seq.size), key=lambda i: (-seq[i], i))):
        p = roomiest[rank]
        assert pack[i] == (p if room[p] >= seq[i] else -1)
    taken = pack[pack >= 0]
    assert len(set(taken.tolist())) == taken.size and (room[taken] >= seq[pack >= 0]).all()


@pytest.mark.parametrize("world", [1, 8, 48, 1024])
def test_groups_hold_equal_work_per_pack(world):
    """The epoch's packs are the multiple of W nearest to its work over the pack budget, in groups of
    at most GROUP_PACKS that differ by at most one pack; each group's work is its share of the packs
    times the total, to within half a fine sample (the fine stream tops up what the coarse one left),
    and each stream keeps its random order across groups."""
    work = COST.per_sample(reference_mix(50_000, seed=5).seq_lens)
    fine_work = float(np.median(work))
    group, group_packs = _cut_groups(work, fine_work, 3.0, 1.0, 10**9, world)
    num_packs = int(group_packs.sum())
    assert num_packs % world == 0 and abs(num_packs - work.sum() / 3.0) <= world / 2
    assert group_packs.max() <= GROUP_PACKS and group_packs.max() - group_packs.min() <= 1
    assert group_packs.size == -(-num_packs // GROUP_PACKS)
    totals = np.bincount(group, weights=work, minlength=group_packs.size)
    cumulative = np.cumsum(totals) - np.cumsum(group_packs) / num_packs * work.sum()
    assert np.abs(cumulative).max() <= fine_work / 2 + 1e-9
    for stream in (work <= fine_work, work > fine_work):
        assert (np.diff(group[stream]) >= 0).all()
    # enough packs for the tokens: 1M tokens at 10,000 per pack need 100 packs whatever the work
    _, group_packs = _cut_groups(work, fine_work, 1e6, 1e6, 10_000, world)
    assert group_packs.sum() == max(world, -(-100 // world) * world)


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
