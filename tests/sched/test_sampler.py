"""DualConstraintBucketSampler (adaptiveload/sched/sampler.py): rule, coverage, ranks, policies, resume
(resume of PackingSampler too: the resume machinery is shared)."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.sched import DualConstraintBucketSampler, PackingSampler, dual_constraint_batch_size, reference_mix
from adaptiveload.sched.cost_model import QuadraticCostModel
from adaptiveload.sched.shapes import tokens_from_latent

COST = QuadraticCostModel(18.75e-3, 7.16e-6, 3.957e-10)


def _all_ranks(shapes, world, **kw):
    return [DualConstraintBucketSampler(shapes, num_replicas=world, rank=r, **kw) for r in range(world)]


def _seq_lens(shapes):
    shapes = np.asarray(shapes)
    return shapes if shapes.ndim == 1 else tokens_from_latent(shapes)


# shapes from a handful of buckets, as latent (T, H, W) or as sequence lengths
_shapes = st.one_of(
    st.lists(st.sampled_from([(1, 60, 104), (5, 60, 104), (21, 60, 104), (1, 90, 160), (21, 90, 160)]),
             min_size=1, max_size=120).map(np.array),
    st.lists(st.sampled_from([100, 300, 700, 1500]), min_size=1, max_size=120).map(np.array),
)


@given(_shapes, st.integers(1, 5), st.booleans(), st.sampled_from(["random", "cost_grouped"]), st.integers(0, 3))
def test_plan_properties(shapes, world, drop_last, policy, epoch):
    s = _seq_lens(shapes)
    m_mem = int(s.max()) * 3
    kw = dict(m_mem=m_mem, m_comp=2.0 * float(s.max()) ** 1.5, p=1.5, seed=7, policy=policy, drop_last=drop_last)
    samplers = _all_ranks(shapes, world, **kw)
    for smp in samplers:
        smp.set_epoch(epoch)
    plans = [smp.epoch_plan() for smp in samplers]
    # every rank builds the identical plan
    for other in plans[1:]:
        np.testing.assert_array_equal(other.step_batches, plans[0].step_batches)
        np.testing.assert_array_equal(other.order, plans[0].order)
    yielded = [list(smp) for smp in samplers]
    # same number of steps on every rank, equal to len()
    assert len({len(y) for y in yielded}) == 1 and all(len(y) == len(smp) for y, smp in zip(yielded, samplers))
    expected_b = dual_constraint_batch_size(s, m_mem, kw["m_comp"], 1.5)
    counts = np.zeros(len(s), dtype=np.int64)
    for y in yielded:
        for batch in y:
            assert len(batch) >= 1
            shp = shapes[batch]
            assert (shp == shp[0]).all()  # one shape per batch
            assert len(batch) <= expected_b[batch[0]]  # never over the rule's batch size
            np.add.at(counts, batch, 1)
    np.testing.assert_array_equal(plans[0].sample_counts(len(s)), counts)
    # the (bucket, B) kinds a run warms up on: every batch of the epoch is one of them, and without
    # drop_last every kind occurs (no batch is dropped); recomputed here from the samples themselves
    plan = plans[0]
    ids = plan.step_batches.reshape(-1)
    seen = {(int(k), int(b)) for k, b in zip(plan.batch_bucket[ids], plan.batch_size[ids])}
    kinds = {tuple(kind) for kind in samplers[0].batch_kinds().tolist()}
    assert seen <= kinds and (drop_last or seen == kinds)
    assert all(b >= 1 for _, b in kinds)
    if drop_last:
        assert counts.max(initial=0) <= 1  # no sample twice: batches of different ranks are disjoint
    else:
        assert counts.min() >= 1  # every sample used
        # extra uses only from whole repeated batches: at most W - 1 of them
        repeats = sum(len(b) for y in yielded for b in y) - len(s)
        assert counts.sum() - len(s) == repeats and repeats <= (world - 1) * expected_b.max()


def test_batch_kinds_hand_computed():
    """Buckets of 5 / 2 / 4 samples at S = 100 / 300 / 700 with m_mem = 800 tokens: B = 8 / 2 / 1.
    Kinds: bucket 0 one partial batch of 5 (fewer samples than B), bucket 1 a full batch of 2,
    bucket 2 full batches of 1; drop_last keeps only full batches."""
    shapes = np.array([100] * 5 + [300] * 2 + [700] * 4)
    assert DualConstraintBucketSampler(shapes, m_mem=800, num_replicas=1, rank=0).batch_kinds().tolist() == [
        [0, 5], [1, 2], [2, 1]]
    assert DualConstraintBucketSampler(shapes, m_mem=800, num_replicas=1, rank=0,
                                       drop_last=True).batch_kinds().tolist() == [[1, 2], [2, 1]]
    # 7 samples of S = 300 at B = 2: full batches of 2 and a partial batch of 1
    assert DualConstraintBucketSampler([300] * 7, m_mem=600, num_replicas=1, rank=0).batch_kinds().tolist() == [
        [0, 1], [0, 2]]


def test_exactly_once_when_batches_divide():
    # batch sizes 1200 // S = 12, 6, 4, 3 and twice as many samples per bucket: 8 full batches,
    # W = 4 -> no partial batch, no padding: each sample exactly once
    seq = np.repeat([100, 200, 300, 400], [24, 12, 8, 6])
    samplers = _all_ranks(seq, 4, m_mem=1200)
    assert samplers[0].bucket_batch_sizes.tolist() == [12, 6, 4, 3] and len(samplers[0]) == 2
    counts = np.zeros(len(seq), dtype=int)
    for step_batches in zip(*[list(s) for s in samplers]):
        flat = [i for b in step_batches for i in b]
        assert len(flat) == len(set(flat))  # disjoint within a step
        np.add.at(counts, flat, 1)
    assert counts.tolist() == [1] * len(seq)


def test_reference_mix_rule_and_epochs():
    m = reference_mix(20_000, seed=1)
    smp = DualConstraintBucketSampler(m.latent_shapes, m_mem=151200, m_comp=1.5 * 75600**1.41, p=1.41, num_replicas=8, rank=3)
    assert len(smp.bucket_keys) == 12
    np.testing.assert_array_equal(smp.bucket_batch_sizes,
                                  dual_constraint_batch_size(smp.bucket_seq_lens, 151200, 1.5 * 75600**1.41, 1.41))
    e0 = smp.epoch_plan(0)
    assert np.array_equal(e0.step_batches, smp.epoch_plan(0).step_batches)
    e1 = smp.epoch_plan(1)
    assert not np.array_equal(e0.order, e1.order)
    assert e0.sample_counts(len(m)).min() == 1
    assert (e0.step_batch_sizes() * e0.step_seq_lens() <= 151200).all()
    # a different seed gives a different plan
    other = DualConstraintBucketSampler(m.latent_shapes, m_mem=151200, num_replicas=8, rank=3, seed=1)
    assert not np.array_equal(other.epoch_plan(0).order, e0.order)


def test_cost_grouped_steps_are_contiguous_in_cost():
    m = reference_mix(5000, seed=2)
    smp = DualConstraintBucketSampler(m.latent_shapes, m_mem=151200, num_replicas=4, rank=0, policy="cost_grouped",
                                      cost_model=COST)
    ep = smp.epoch_plan(0)
    cost = COST.predict(ep.step_batch_sizes(), ep.step_seq_lens())
    lo, hi = cost.min(axis=1), cost.max(axis=1)
    order = np.lexsort((hi, lo))
    # groups of W consecutive batches in cost order: step intervals do not overlap
    assert (hi[order][:-1] <= lo[order][1:] + 1e-12).all()
    # and the steps are shuffled, not in cost order
    assert not (np.diff(lo) >= 0).all()
    rnd = DualConstraintBucketSampler(m.latent_shapes, m_mem=151200, num_replicas=4, rank=0, cost_model=COST).epoch_plan(0)
    rcost = COST.predict(rnd.step_batch_sizes(), rnd.step_seq_lens())
    cv = lambda c: np.mean(c.std(axis=1) / c.mean(axis=1))  # noqa: E731
    assert cv(cost) < 0.05 < 0.2 < cv(rcost)


def test_step_budget_with_cost_model():
    seq = np.repeat([1560, 32760, 75600], 10)
    budget = 1.0
    smp = DualConstraintBucketSampler(seq, m_mem=151200, cost_model=COST, step_budget_s=budget)
    b = smp.bucket_batch_sizes
    assert (COST.predict(b, smp.bucket_seq_lens)[b > 1] <= budget).all()
    assert (COST.predict(b + 1, smp.bucket_seq_lens) > budget).all() or (b * smp.bucket_seq_lens <= 151200).all()
    assert b.tolist() == [max(1, min(151200 // s, int((budget - COST.c0) // (COST.c1 * s + COST.c2 * s * s))))
                          for s in (1560, 32760, 75600)]


def test_oversized_buckets():
    seq = np.array([100, 100, 5000, 100])
    with pytest.raises(ValueError, match=r"S=5000, 1 samples\); raise the memory budget"):
        DualConstraintBucketSampler(seq, m_mem=1000)
    smp = DualConstraintBucketSampler(seq, m_mem=1000, drop_oversized=True)
    used = sorted(i for b in smp for i in b)
    assert used == [0, 1, 3]


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 2, "num_replicas": 2}, r"Invalid rank 2, rank should be in the interval \[0, 1\]"),
    ({"num_replicas": 0}, "Invalid num_replicas 0"),
    ({"policy": "fastest"}, "Invalid policy 'fastest'"),
    ({"m_comp": 10.0}, "needs the exponent p"),
    ({"step_budget_s": 1.0}, "needs cost_model"),
    ({"policy": "cost_grouped"}, "needs a cost_model or the exponent p"),
    ({"shapes_or_seq_lens": []}, "non-empty"),
    ({"shapes_or_seq_lens": [[1, 2]]}, r"got shape \[1, 2\]"),
    ({"shapes_or_seq_lens": [5, 0, 3]}, r"got \[0\] at sample 1"),
])
def test_bad_arguments(kwargs, match):
    args = {"shapes_or_seq_lens": [10, 20, 30], "m_mem": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        DualConstraintBucketSampler(**args)


def test_defaults_from_torch_distributed_uninitialised():
    smp = DualConstraintBucketSampler([10, 20, 30], m_mem=100)
    assert (smp.num_replicas, smp.rank) == (1, 0)


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _loader(sampler):
    return torch.utils.data.DataLoader(_Indexed(sampler.num_samples), batch_sampler=sampler, num_workers=2,
                                       collate_fn=list, prefetch_factor=4)


@pytest.mark.parametrize("policy", ["random", "cost_grouped", "packed"])
def test_resume_mid_epoch_through_dataloader_with_workers(policy):
    """Both samplers (the bucket sampler's step orders, and packing) resume exactly."""
    m = reference_mix(3000, seed=4)
    kw = dict(m_mem=151200, num_replicas=2, rank=1, seed=11, cost_model=COST)

    def make():
        if policy == "packed":
            return PackingSampler(m.latent_shapes, step_budget_s=2.85, **kw)
        return DualConstraintBucketSampler(m.latent_shapes, policy=policy, **kw)

    full = make()
    full.set_epoch(3)
    reference = list(_loader(full))
    assert len(reference) == len(full) > 20

    first = make()
    first.set_epoch(3)
    seen, state = [], None
    for step, batch in enumerate(_loader(first), start=first.resume_step):
        seen.append(batch)
        if step + 1 == 13:  # checkpoint after 13 trained steps; the workers have fetched further ahead
            state = first.state_dict(consumed_steps=step + 1)
            break
    assert state["consumed_steps"] == 13 and state["epoch"] == 3

    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the training loop re-selects the same epoch: the resume point is kept
    assert resumed.resume_step == 13 and len(resumed) == len(full) - 13
    rest = list(enumerate(_loader(resumed), start=resumed.resume_step))
    assert rest[0][0] == 13
    assert seen[:13] + [b for _, b in rest] == reference
    # the next epoch starts from its beginning
    resumed.set_epoch(4)
    assert resumed.resume_step == 0 and len(resumed) == len(full)


def test_resume_point_is_used_once_and_dropped_on_another_epoch():
    smp = DualConstraintBucketSampler(np.repeat([100, 200], 50), m_mem=400, num_replicas=2, rank=0)
    n = len(smp)
    smp.load_state_dict(smp.state_dict(consumed_steps=5))
    assert len(list(smp)) == n - 5 and len(list(smp)) == n
    smp.load_state_dict(smp.state_dict(consumed_steps=5))
    smp.set_epoch(1)
    assert len(list(smp)) == n


def test_state_dict_validation():
    seq = np.repeat([100, 200], 50)
    smp = DualConstraintBucketSampler(seq, m_mem=400, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"Invalid consumed_steps 99, it should be in the interval \[0, "):
        smp.state_dict(consumed_steps=99)
    state = smp.state_dict(consumed_steps=2)
    with pytest.raises(ValueError, match="num_replicas was 2, this sampler has 4"):
        DualConstraintBucketSampler(seq, m_mem=400, num_replicas=4, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed was 0"):
        DualConstraintBucketSampler(seq, m_mem=400, num_replicas=2, rank=0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        DualConstraintBucketSampler(seq[::-1].copy(), m_mem=400, num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        DualConstraintBucketSampler(seq, m_mem=300, num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="missing field 'epoch'"):
        smp.load_state_dict({k: v for k, v in state.items() if k != "epoch"})


@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([2, 4, 60, 90]), st.integers(1, 3)), min_size=1,
                max_size=60), st.booleans())
def test_group_buckets_matches_numpy_unique(rows, huge):
    from adaptiveload.sched.sampler import group_buckets
    keys = np.array(rows, dtype=np.int64)
    if huge:  # values beyond the bincount table take the sorting path
        keys[:, 2] += 1 << 25
    got_keys, got_inverse, got_counts = group_buckets(keys)
    want_keys, want_inverse, want_counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_inverse, want_inverse.reshape(-1))
    np.testing.assert_array_equal(got_counts, want_counts)
    seq_keys, seq_inverse, _ = group_buckets(keys[:, 0])
    np.testing.assert_array_equal(seq_keys[:, 0], np.unique(keys[:, 0]))
    np.testing.assert_array_equal(seq_keys[seq_inverse, 0], keys[:, 0])
