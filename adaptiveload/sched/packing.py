"""Balanced packing: :class:`PackingSampler` gives each rank a *pack* of samples of different lengths
per global step, with the predicted step time of every rank nearly equal, and :func:`collate_packed`
builds a pack's layout.

Where the bucket sampler (:class:`~adaptiveload.sched.sampler.DualConstraintBucketSampler`) stacks
samples of one shape and balances ranks only by putting batches of similar cost into one step (policy
``cost_grouped``: a step then holds only long clips or only images), a pack mixes lengths, so a step
can take samples in random order and still give every rank the same predicted time. The same idea
balances packed image+video batches in KnapFormer (a knapsack over a linear + quadratic cost model),
variable micro-batches per rank in Megatron-LM's dynamic context parallelism, and WLB-LLM; here the
cost model is the one calibrated on the live model (:mod:`adaptiveload.sched.calibration`).

Predicted time of a pack (:meth:`~adaptiveload.sched.cost_model.CostModel.predict_packs`):
``t = c0 + sum_i (c1*S_i + c2*S_i^2)`` for the quadratic model -- attention runs per sample.

Epoch plan (vectorised numpy, every rank computes it from ``(seed, epoch)`` without communication):

1. the samples are put in a random order and split, in that order, into two streams: samples whose
   predicted work is at most the median sample's (the *fine* stream) and the rest;
2. the epoch gets the multiple of W packs nearest to its predicted work over the step budget (so
   that its last step needs no padding), cut into groups of at most :data:`GROUP_PACKS` packs:
   each group takes the next samples of the coarse stream up to its share of the coarse work and
   then the next samples of the fine stream up to its share of the total, so that every group holds
   the same predicted work per pack (to within half a fine sample), close to the step budget;
3. within each group, longest-processing-time-first (LPT) under the token limit: samples by
   predicted work, largest first, each to the pack that has room for it below the group's work per
   pack (without the samples longer than that) and the most work left per token left (plain LPT's
   least-loaded pack when tokens do not bind; :func:`_lpt`), so that packs which took samples of few
   seconds per token get the denser ones and reach the budget before ``m_mem``; a sample that fits
   in no pack waits for the next round, where the waiting samples form new groups -- or, when fewer
   samples wait than there are ranks, join the packs with the most tokens left (:func:`_top_up`);
4. steps of W packs: within windows of :data:`STEP_WINDOW` steps, packs whose predicted times lie in
   the same band of :data:`LOAD_TOLERANCE` times the median (bands centred on the median) are put in
   random order and the bands follow each other, W consecutive packs form a step; then the steps
   are shuffled. A pack whose time stands out (one long clip over the budget, a pack full of tokens
   before it reached the budget) trains beside packs of its own time, the others -- the packs
   within a band of the median -- beside packs of random content;
5. when the packs are not a multiple of W after all (packs left empty: fewer samples than packs, or
   a round for a few waiting samples), the last step gets a padding pack on each rank left without
   one: one sample (the shortest) with loss weight 0 (:meth:`PackingSampler.loss_weight`), so every
   rank runs the same number of steps.

Every kept sample is trained exactly once per epoch. Random order: the composition of a step is
that of random samples, except for the packs of step 4's outer bands
(``adaptiveload simulate`` reports ``composition_ks`` and ``composition_lag1_corr`` per policy).
Packs stand out when the budget is below the longest sample's time or when the memory budget
leaves no way to fill every pack to the budget (a pack without long clips runs out of tokens
first); the plan's budget (:func:`~adaptiveload.sched.plan.make_plan`) avoids the first.

Resume: as the bucket sampler (:mod:`adaptiveload.sched.sampler`), ``state_dict(consumed_steps=k)``
and ``load_state_dict``; a DataLoader's ``batch_sampler``, with any number of workers.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from adaptiveload.sched.cost_model import CostModel
from adaptiveload.sched.sampler import (DualConstraintBucketSampler, EpochBatchSampler, _dist_default, bucket_tokens,
                                        group_buckets)
from adaptiveload.sched.shapes import WAN_PATCH_SIZE, tokens_from_latent

logger = logging.getLogger("adaptiveload.sched")

# Packs balanced together by one LPT (step 3 of the module docstring), the packer's look-ahead. More
# packs give LPT more small samples to level with (on the reference mix at W = 8, idle fell from about
# 0.03 with 8 packs to 0.01 with 32) and cost time linearly (the vectorised LPT touches every pack of a
# group for every sample).
GROUP_PACKS = 32
# Predicted times within this share of the median pack time are one band (step 4): a step's packs
# differ by at most about two bands. Wider bands keep steps closer to random samples, narrower ones
# balance better.
LOAD_TOLERANCE = 0.02
# Steps (of consecutive groups) among whose packs step 4 forms steps of one band.
STEP_WINDOW = 16
# Rounds of step 3's water level (a group's work per pack without the samples longer than it); each
# round finds the samples the previous level left above it, and the longest samples of a corpus are
# above the first.
WATER_LEVEL_ROUNDS = 3
POLICY = "packed"


@dataclass
class EpochPacking:
    """Which pack every rank trains at every step of one epoch, without loading data.

    Attributes:
        step_packs: int64 [steps, world_size], the pack rank r trains at step s; -1 = a padding pack.
        pack_start: int64 [num_packs], offset of each pack in ``order``.
        pack_size: int64 [num_packs], samples in each pack.
        order: int32 (int64 from 2^31 samples) [num_kept_samples], sample indices grouped by pack.
        seq_lens: int32 (int64 from 2^31 tokens) [num_samples], tokens of every sample of the corpus.
        padding_sample: the sample a padding pack holds (the shortest kept one), trained with loss weight 0.
    """

    step_packs: np.ndarray
    pack_start: np.ndarray
    pack_size: np.ndarray
    order: np.ndarray
    seq_lens: np.ndarray
    padding_sample: int

    @property
    def num_steps(self) -> int:
        """Global steps in the epoch (the same on every rank)."""
        return int(self.step_packs.shape[0])

    def indices(self, step: int, rank: int) -> list[int]:
        """Sample indices rank ``rank`` trains at ``step`` (``[padding_sample]`` for a padding pack)."""
        pack = int(self.step_packs[step, rank])
        if pack < 0:
            return [self.padding_sample]
        start = int(self.pack_start[pack])
        return self.order[start:start + int(self.pack_size[pack])].tolist()

    def loss_weights(self) -> np.ndarray:
        """float64 [steps, world_size]: 1 for a pack of samples, 0 for a padding pack."""
        return (self.step_packs >= 0).astype(np.float64)

    def pack_times(self, cost_model: CostModel) -> np.ndarray:
        """float64 [num_packs]: predicted seconds of every pack (:meth:`CostModel.predict_packs`)."""
        return cost_model.predict_packs(self.seq_lens[self.order], self.pack_size)

    def step_costs(self, cost_model: CostModel) -> np.ndarray:
        """float64 [steps, world_size]: predicted seconds of each rank at each step (a padding pack
        runs its one sample)."""
        times = np.append(self.pack_times(cost_model),
                          cost_model.predict_packs([self.seq_lens[self.padding_sample]], [1]))
        return times[self.step_packs]  # -1 picks the padding pack's time

    def step_tokens(self) -> np.ndarray:
        """int64 [steps, world_size]: tokens each rank trains at each step (0 for a padding pack)."""
        tokens = np.add.reduceat(self.seq_lens[self.order].astype(np.int64), self.pack_start)
        return np.append(tokens, 0)[self.step_packs]

    def step_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """``(step, sample)``: int64 arrays [num_kept_samples], the global step of every trained
        sample (padding excluded)."""
        pack_step = np.empty(self.pack_size.size, dtype=np.int64)
        steps, _ = np.nonzero(self.step_packs >= 0)
        pack_step[self.step_packs[self.step_packs >= 0]] = steps
        return np.repeat(pack_step, self.pack_size), self.order.astype(np.int64)

    def sample_counts(self, num_samples: int) -> np.ndarray:
        """int64 [num_samples]: how often each sample is trained this epoch (1, or 0 when dropped;
        padding excluded)."""
        return np.bincount(self.order, minlength=num_samples).astype(np.int64)


class PackingSampler(EpochBatchSampler):
    """Distributed batch sampler of cost-balanced packs: per global step, one list of sample indices
    per rank, of any lengths, with nearly equal predicted step time on every rank.

    Use as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_packed, num_workers=...)``
    and weight each step's loss by :meth:`loss_weight` (0 for the padding pack of the last step).

    Args:
        shapes_or_seq_lens: int array [n, 3] of latent shapes (T, H, W) or [n] of sequence lengths;
            tokens are ``T*H*W / prod(patch_size)``.
        m_mem: the per-rank memory budget, tokens per pack: ``sum_i S_i <= m_mem``.
        step_budget_s: the per-rank step-time budget, seconds: each pack's predicted time is about
            this (the plan's choice, :func:`~adaptiveload.sched.plan.make_plan` with policy ``packed``);
            the packs fill whole steps, so their mean time is the budget to within half a step's share
            of the epoch (less where ``m_mem`` binds).
        cost_model: predicts a pack's time (:meth:`CostModel.predict_packs`).
        num_replicas, rank: world size and this rank (default: from ``torch.distributed``, else 1, 0).
        seed: seed of the random order (the same on every rank).
        drop_oversized: drop samples longer than ``m_mem`` (logged with their indices) instead of raising.
        patch_size: DiT patch (pt, ph, pw) for latent shapes.

    Raises:
        ValueError: a bad shape array (first bad sample named), a non-positive ``m_mem``, a
            ``step_budget_s`` not above the cost model's fixed time per step, a bad
            ``num_replicas``/``rank``, or samples longer than ``m_mem`` without ``drop_oversized``
            (the first ones named with their index and S).

    Example::

        >>> from adaptiveload.sched.cost_model import QuadraticCostModel
        >>> cost = QuadraticCostModel(0.02, 7e-6, 4e-10)
        >>> seq = [1560] * 60 + [32760] * 10 + [75600] * 4
        >>> ranks = [PackingSampler(seq, 151200, 1.0, cost, num_replicas=2, rank=r) for r in range(2)]
        >>> steps = [list(s) for s in ranks]
        >>> len(steps[0]) == len(steps[1]) == len(ranks[0]), sorted(i for s in steps for p in s for i in p) == list(range(74))
        (True, True)
    """

    def __init__(self, shapes_or_seq_lens, m_mem: int, step_budget_s: float, cost_model: CostModel,
                 num_replicas=None, rank=None, seed: int = 0, *, drop_oversized: bool = False,
                 patch_size=WAN_PATCH_SIZE):
        self.num_replicas, self.rank = _dist_default(num_replicas, rank)
        if isinstance(m_mem, bool) or not isinstance(m_mem, (int, np.integer)) or m_mem < 1:
            raise ValueError(f"Invalid m_mem {m_mem!r}, m_mem (tokens per pack) should be a positive integer")
        if not (isinstance(step_budget_s, (int, float, np.floating)) and math.isfinite(step_budget_s)
                and step_budget_s > 0):
            raise ValueError(f"Invalid step_budget_s {step_budget_s!r}, it should be a positive number of seconds")
        if not isinstance(cost_model, CostModel):
            raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        self.m_mem, self.step_budget_s, self.cost_model = int(m_mem), float(step_budget_s), cost_model
        self.seed, self.policy = int(seed), POLICY
        self._init_epochs()
        self._packing: tuple[int, EpochPacking] | None = None

        bucket_keys, inverse, _ = group_buckets(shapes_or_seq_lens)
        bucket_seq = bucket_tokens(bucket_keys, patch_size)
        self.num_samples = int(inverse.size)
        # narrow integers: an epoch of 10M samples is planned in well under 2 GB
        index_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        bucket_seq = bucket_seq.astype(np.int32 if bucket_seq.max() < 2**31 else np.int64)
        inverse = inverse.astype(np.int16 if bucket_seq.size < 2**15 else np.int32)
        self.seq_lens = bucket_seq[inverse]
        over = np.flatnonzero(self.seq_lens > self.m_mem)
        if over.size:
            shown = ", ".join(f"sample {int(i)} (S={int(self.seq_lens[i]):,})" for i in over[:5])
            more = f" and {over.size - 5} more" if over.size > 5 else ""
            if not drop_oversized:
                raise ValueError(f"{over.size} sample(s) longer than m_mem={self.m_mem:,} tokens per pack: {shown}{more}; "
                                 f"raise the memory budget (m_mem; --m-mem or --memory-budget-gb on the command line) "
                                 f"or drop them (drop_oversized=True; --drop-oversized)")
            logger.warning("dropping %d sample(s) longer than m_mem=%s tokens: %s%s", over.size, f"{self.m_mem:,}",
                           shown, more)
        self.dropped_samples = over
        if over.size == self.num_samples:
            raise ValueError(f"every sample is longer than m_mem={self.m_mem:,} tokens per pack: nothing to train")
        self._kept = np.flatnonzero(self.seq_lens <= self.m_mem).astype(index_dtype)
        # per bucket: predicted work (the pack time without its intercept) and its rank, largest first
        bucket_work = cost_model.per_sample(bucket_seq)
        rank_of = np.empty(bucket_seq.size, dtype=np.int32)
        rank_of[np.argsort(-bucket_work, kind="stable")] = np.arange(bucket_seq.size)
        self._bucket_work, self._bucket_rank, self._bucket_seq, self._inverse = bucket_work, rank_of, bucket_seq, inverse
        kept_work = bucket_work[inverse[self._kept]]
        self._fine_work = float(np.median(kept_work))
        # the group total: GROUP_PACKS packs at the step budget, without the fixed time each pays
        fixed = float(cost_model.predict_packs([], [0])[0])
        if step_budget_s <= fixed:
            raise ValueError(f"Invalid step_budget_s {step_budget_s!r}: a step's fixed time alone is {fixed:.4g} s "
                             f"under this cost model, no pack fits in it")
        self._pack_work = step_budget_s - fixed
        self.padding_sample = int(self._kept[np.argmin(self.seq_lens[self._kept])])

    @classmethod
    def from_plan(cls, plan, shapes_or_seq_lens, num_replicas=None, rank=None, seed: int = 0) -> "PackingSampler":
        """The sampler of a :class:`~adaptiveload.sched.plan.Plan` with policy ``packed``: its ``m_mem``,
        step budget, cost model, ``drop_oversized`` and patch size. Logs a warning when the world size
        differs from the one planned for.

        Raises:
            ValueError: the plan's policy is not ``packed``, or as the constructor.
        """
        if plan.policy != POLICY:
            raise ValueError(f"plan policy {plan.policy!r} is not {POLICY!r}: use DualConstraintBucketSampler.from_plan")
        sampler = cls(shapes_or_seq_lens, plan.m_mem, plan.step_budget_s, plan.cost_model, num_replicas=num_replicas,
                      rank=rank, seed=seed, drop_oversized=plan.drop_oversized, patch_size=plan.patch_size)
        if sampler.num_replicas != plan.world_size:
            logger.warning("plan was made for world size %d, sampler runs with %d: the budget may no longer be the best",
                           plan.world_size, sampler.num_replicas)
        return sampler

    # ------------------------------------------------------------------------------ epoch plan

    def epoch_plan(self, epoch: int | None = None) -> EpochPacking:
        """The packs of ``epoch`` (default: the current one) for all ranks; identical on every rank.
        The last one computed is kept (``set_epoch`` computes the new epoch's)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._packing is None or self._packing[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._packing = (epoch, self._pack(rng))
        return self._packing[1]

    def _pack(self, rng: np.random.Generator) -> EpochPacking:
        todo = self._kept[rng.permutation(self._kept.size)]
        bucket = self._inverse[todo]  # gathered once; per-bucket tables stay in cache
        work32 = self._bucket_work.astype(np.float32)  # LPT's choice; exact times are summed in float64
        samples, packs, num_packs, topped_up = [], [], 0, False
        while todo.size:  # the samples step 3 could not place form the groups of another round
            if samples and not topped_up and todo.size < self.num_replicas:
                # so few that new packs would leave most of a step padding: the packs with room take them
                topped_up = True
                done = np.concatenate(packs)
                held = np.bincount(done, minlength=num_packs)
                tokens = np.bincount(done, weights=self.seq_lens[np.concatenate(samples)], minlength=num_packs)
                pack = _top_up(np.where(held > 0, self.m_mem - tokens, -1), self.seq_lens[todo])
                samples.append(todo[pack >= 0])
                packs.append(pack[pack >= 0].astype(todo.dtype))
                todo, bucket = todo[pack < 0], bucket[pack < 0]
                continue
            group, group_packs = _cut_groups(self._bucket_work[bucket], self._fine_work, self._pack_work,
                                             float(self._bucket_seq[bucket].sum(dtype=np.int64)), self.m_mem,
                                             self.num_replicas)
            num_groups = group_packs.size
            key = group.astype(np.int64 if num_groups * self._bucket_work.size >= 2**31 else np.int32)
            by_group = np.argsort(key * self._bucket_work.size + self._bucket_rank[bucket], kind="stable")
            del key
            todo, group, bucket = todo[by_group], group[by_group], bucket[by_group]
            del by_group
            slot = _lpt(group, self._bucket_seq[bucket], work32[bucket], group_packs, self.m_mem)
            placed = slot >= 0
            samples.append(todo[placed])
            packs.append((num_packs + group[placed] * GROUP_PACKS + slot[placed]).astype(todo.dtype))
            num_packs += num_groups * GROUP_PACKS
            todo, bucket = todo[~placed], bucket[~placed]
        samples, packs = np.concatenate(samples), np.concatenate(packs)
        # samples of one pack are neighbours (one group): a stable sort by pack merges short runs
        by_pack = np.argsort(packs, kind="stable")
        samples, packs = samples[by_pack], packs[by_pack]
        del by_pack
        sizes = np.bincount(packs, minlength=num_packs)
        times = np.bincount(packs, weights=self._bucket_work[self._inverse[samples]], minlength=num_packs)[sizes > 0]
        sizes = sizes[sizes > 0]  # the empty packs of a round with fewer samples than packs go
        return EpochPacking(_form_steps(times, self.num_replicas, rng), np.cumsum(sizes) - sizes, sizes.astype(np.int64),
                            samples, self.seq_lens, self.padding_sample)

    # ------------------------------------------------------------------------------ EpochBatchSampler

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields and compute its packs (on every rank)."""
        super().set_epoch(epoch)
        self.epoch_plan()

    def steps_per_epoch(self) -> int:
        """Global steps (= packs per rank) in the current epoch."""
        return self.epoch_plan().num_steps

    def loss_weight(self, step: int) -> float:
        """Weight of this rank's loss at global ``step`` of the current epoch: 0.0 for a padding
        pack (a rank left without samples in the last step), else 1.0.

        Raises:
            IndexError: ``step`` outside the epoch.
        """
        packing = self.epoch_plan()
        if not 0 <= step < packing.num_steps:
            raise IndexError(f"step {step} outside the epoch's {packing.num_steps} steps")
        return float(packing.step_packs[step, self.rank] >= 0)

    def _epoch_batches(self, start: int):
        packing = self.epoch_plan()
        for step in range(start, packing.num_steps):
            yield packing.indices(step, self.rank)

    def _plan_inputs(self) -> tuple[tuple, tuple]:
        return (self._inverse, self._bucket_work, self._kept), (self.m_mem, self.step_budget_s)


def _cut_groups(work, fine_work, pack_work, tokens, m_mem, world_size) -> tuple[np.ndarray, np.ndarray]:
    """Step 2 of the module docstring: the number of packs, and the group of every sample.

    The packs: the multiple of ``world_size`` nearest to ``total work / pack_work`` (at least one
    step, and enough packs for the tokens), so that the epoch's last step needs no padding and the
    mean pack work stays within half a step's share of ``pack_work``; spread over groups of at most
    :data:`GROUP_PACKS` packs, the group sizes differing by at most one.

    Args:
        work: float64 [n], predicted work of the samples in their random order (seconds).
        fine_work: the largest work of the fine stream (the median sample's).
        pack_work: the pack budget without its fixed time (seconds).
        tokens: total tokens of the samples; m_mem: tokens per pack.
        world_size: the packs are a multiple of it (1 for any number).

    Returns:
        ``(group, group_packs)``: int32 [n] (int64 from 2^31 groups), the group of each sample, and
        int64 [num_groups], the packs of each group; a group's work is the total times its share
        of the packs.
    """
    total = float(work.sum())
    steps = max(1, round(total / pack_work / world_size), math.ceil(tokens / m_mem / world_size))
    num_packs = steps * world_size
    num_groups = -(-num_packs // GROUP_PACKS)
    group_packs = np.full(num_groups, num_packs // num_groups, dtype=np.int64)
    group_packs[:num_packs % num_groups] += 1
    ends = np.cumsum(group_packs) / num_packs  # share of the work up to the end of each group
    fine = work <= fine_work
    coarse = work[~fine]
    coarse_cum = np.cumsum(coarse)
    coarse_total = float(coarse_cum[-1]) if coarse.size else 0.0
    # the coarse sample whose middle lies in (ends[k-1] c, ends[k] c] joins group k (c = coarse work)
    coarse_group = np.minimum(np.searchsorted(ends * coarse_total, coarse_cum - coarse / 2), num_groups - 1)
    coarse_upto = np.cumsum(np.bincount(coarse_group, weights=coarse, minlength=num_groups))
    # the fine stream tops each group up to its share: groups 0..k end at ends[k] * total
    finer = work[fine]
    fine_cum = np.cumsum(finer)
    fine_ends = np.maximum.accumulate(np.clip(ends * total - coarse_upto, 0.0,
                                              float(fine_cum[-1]) if finer.size else 0.0))
    group = np.empty(work.size, dtype=np.int32 if num_groups < 2**31 else np.int64)
    group[~fine] = coarse_group
    group[fine] = np.minimum(np.searchsorted(fine_ends, fine_cum - finer / 2), num_groups - 1)
    return group, group_packs


def _lpt(group, seq, work, group_packs, m_mem: int) -> np.ndarray:
    """Step 3: longest processing time first within every group, all groups at once, under the token
    limit.

    A group's packs aim at its water level ``B``: its work per pack, leaving out the samples longer
    than that and as many packs (such a sample alone passes ``B``; :data:`WATER_LEVEL_ROUNDS`). Each sample
    (work w, S tokens) goes to the pack with the most work left per token left,
    ``(B - load) / (m_mem - tokens)``, among those with room for it below ``B``
    (``tokens + S <= m_mem`` and ``load + w <= B``); when no pack has, to the least-loaded pack with
    room for it (plain LPT). As in LPT, the packs then end within one sample's work of each other
    where tokens do not bind (a pack passes ``B`` only as the least loaded). The samples come in order
    of falling work, so of falling work per token (``w(S) / S`` grows with S for a cost model convex
    in S), and the ratio sends the denser ones, while they last, to the packs that took samples of few
    seconds per token -- which would otherwise fill up with tokens before they reach ``B``, and leave
    their work to the others.

    Args:
        group: int [n], sorted; seq (tokens, int), work (seconds, float): [n] of the samples in
            that order, work descending within each group (so tokens too: work grows with S).
        group_packs: int [num_groups], packs of each group (1 .. GROUP_PACKS); m_mem: tokens per pack.

    Returns:
        int8 [n]: the pack (0 .. group_packs - 1) of its group each sample joins, -1 when it fits in none.
    """
    group_packs = np.asarray(group_packs)
    num_groups = group_packs.size
    counts = np.bincount(group, minlength=num_groups)
    width = int(counts.max())
    # every group's samples in a row of `width` cells (written in order: the samples are sorted by
    # group), then the rows sorted by sample count and transposed: row j of a table holds every
    # group's j-th largest sample, and the groups that still have one are its first columns
    cell_dtype = np.int32 if num_groups * width < 2**31 else np.int64
    item_cell = np.arange(group.size, dtype=cell_dtype) + (np.arange(num_groups) * width
                                                           - (np.cumsum(counts) - counts)).astype(cell_dtype)[group]
    by_count = np.argsort(-counts, kind="stable")

    def table(values, dtype):
        cells = np.zeros(num_groups * width, dtype=dtype)
        cells[item_cell] = values
        return np.ascontiguousarray(cells.reshape(num_groups, width)[by_count].T)

    table_seq, table_work = table(seq, np.int32), table(work, np.float32)
    table_slot = np.full((width, num_groups), -1, dtype=np.int8)
    active = np.searchsorted(-counts[by_count], -np.arange(width), side="left")  # groups with more than j samples
    packs = group_packs[by_count]
    # B: the group's work over its packs -- without the samples longer than that, each alone in a pack
    # over it, and their packs (found in a few rounds; they are the first rows of the table)
    total = np.bincount(group, weights=work, minlength=num_groups)[by_count]
    level = total / packs
    for _ in range(WATER_LEVEL_ROUNDS):
        alone, alone_work = np.zeros(num_groups), np.zeros(num_groups)
        for j, cols in enumerate(active.tolist()):
            over = table_work[j, :cols] > level[:cols]
            if not over.any():
                break
            alone[:cols] += over
            alone_work[:cols] += np.where(over, table_work[j, :cols], 0.0)
        level = np.where(alone < packs, (total - alone_work) / np.maximum(packs - alone, 1), level)
    target = level.astype(np.float32)
    # per pack: float32 work left to B, int32 tokens left to m_mem and their ratio (exact times are
    # summed later); a group's packs past its own number have neither and are never chosen
    exists = np.arange(GROUP_PACKS) < packs[:, None]
    work_left = np.where(exists, target[:, None], -np.inf).astype(np.float32)
    tokens_left = np.where(exists, m_mem, 0).astype(np.int32)
    # the ratio in float64, kept in float32 (as updated below)
    need = np.where(exists, work_left / np.float64(m_mem), -np.inf).astype(np.float32)
    first = np.arange(num_groups) * GROUP_PACKS
    flat_work, flat_tokens, flat_need = work_left.reshape(-1), tokens_left.reshape(-1), need.reshape(-1)
    for j, cols in enumerate(active.tolist()):
        s, w = table_seq[j, :cols], table_work[j, :cols]
        pick = np.where(work_left[:cols] >= w[:, None], need[:cols], -np.inf).argmax(axis=1)
        cell = first[:cols] + pick
        # the neediest pack under B has no room for the sample, or no pack is under B (the last samples)
        redo = np.flatnonzero((flat_tokens[cell] < s) | (flat_work[cell] < w))
        if redo.size:
            room = tokens_left[redo] >= s[redo, None]
            under = room & (work_left[redo] >= w[redo, None])
            best = np.where(under, need[redo], -np.inf).argmax(axis=1)
            least = np.where(room, -work_left[redo], np.inf).argmin(axis=1)  # the least loaded with room
            rows = np.arange(redo.size)
            pick[redo] = np.where(under[rows, best], best, np.where(room[rows, least], least, -1))
            cell = first[:cols] + pick
        table_slot[j, :cols] = pick
        if redo.size:
            cell, s, w = cell[pick >= 0], s[pick >= 0], w[pick >= 0]
        flat_work[cell] -= w
        flat_tokens[cell] -= s
        flat_need[cell] = flat_work[cell] / np.maximum(flat_tokens[cell], 1)
    slot = np.empty((num_groups, width), dtype=np.int8)
    slot[by_count] = table_slot.T
    return slot.reshape(-1)[item_cell]


def _top_up(room, seq) -> np.ndarray:
    """Step 3's last samples: the longest waiting sample joins the pack with the most room, the next
    the pack with the next most, and so on, where it fits.

    Args:
        room: int [num_packs], tokens each pack has left (negative: no pack); seq: int [n] tokens of
            the waiting samples, n <= num_packs.

    Returns:
        int64 [n]: the pack each sample joins, -1 where it does not fit.
    """
    by_size = np.argsort(-seq, kind="stable")
    roomiest = np.argsort(-room, kind="stable")[:seq.size]
    pack = np.full(seq.size, -1, dtype=np.int64)
    pack[by_size] = np.where(room[roomiest] >= seq[by_size], roomiest, -1)
    return pack


def _form_steps(times, world_size: int, rng: np.random.Generator) -> np.ndarray:
    """Steps 4 and 5: the pack of every rank at every step.

    Args:
        times: float64 [num_packs], predicted work of the packs in the order of the random order.
        world_size: ranks W.

    Returns:
        int64 [ceil(num_packs / W), W]: pack ids, -1 for the padding packs of the last step.
    """
    num_packs = times.size
    median = float(np.median(times))
    # bands centred on the median: the packs near it, most of them, are one band
    band = np.rint((times - median) / (LOAD_TOLERANCE * median)).astype(np.int64)
    band -= band.min()
    window = np.arange(num_packs) // (STEP_WINDOW * world_size)
    shuffled = rng.permutation(num_packs)
    key = window[shuffled] * (int(band.max()) + 1) + band[shuffled]
    order = shuffled[np.argsort(key, kind="stable")]
    steps = -(-num_packs // world_size)
    padded = np.concatenate([order, np.full(steps * world_size - num_packs, -1, dtype=np.int64)])
    return padded.reshape(steps, world_size)[rng.permutation(steps)]


@dataclass
class PackedBatch:
    """A pack's layout, for attention per sample over the concatenated tokens of samples of different shapes.

    Attributes:
        samples: the dataset items of the pack, as given to :func:`collate_packed`.
        latent_shapes: int64 [n, 3], latent (T, H, W) of each sample.
        cu_seqlens: int32 [n + 1], cumulative sequence lengths (tokens after patchify): sample i owns
            tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` (the layout of varlen attention kernels).
        segment_ids: int32 [sum S], the sample each token belongs to.
        max_seqlen: the longest sequence length of the pack (int).
    """

    samples: list
    latent_shapes: torch.Tensor
    cu_seqlens: torch.Tensor
    segment_ids: torch.Tensor
    max_seqlen: int

    def __len__(self) -> int:
        return len(self.samples)


def collate_packed(samples, patch_size=WAN_PATCH_SIZE) -> PackedBatch:
    """Build the layout of a pack from its dataset items (a DataLoader ``collate_fn``; give another
    patch size with ``functools.partial``).

    Args:
        samples: list of n items, each a tensor [C, T, H, W] (latents) or a mapping with such a
            ``"latents"`` tensor (the dataset's own fields are kept in ``PackedBatch.samples``).
        patch_size: DiT patch (pt, ph, pw); ``S = (T/pt)(H/ph)(W/pw)`` tokens per sample.

    Returns:
        :class:`PackedBatch` with ``cu_seqlens`` int32 [n + 1], ``segment_ids`` int32 [sum S] and
        ``latent_shapes`` int64 [n, 3].

    Raises:
        ValueError: an empty pack, an item without latents of at least 3 dims, or a latent shape that
            is not a multiple of the patch (naming the item's position and its ``"index"`` when given).

    Example::

        >>> pack = collate_packed([torch.zeros(16, 1, 4, 6), {"index": 7, "latents": torch.zeros(16, 2, 2, 2)}])
        >>> pack.cu_seqlens.tolist(), pack.segment_ids.tolist(), pack.latent_shapes.tolist(), pack.max_seqlen
        ([0, 6, 8], [0, 0, 0, 0, 0, 0, 1, 1], [[1, 4, 6], [2, 2, 2]], 6)
    """
    if len(samples) == 0:
        raise ValueError("collate_packed: empty pack")
    shapes = []
    for i, item in enumerate(samples):
        latents = item.get("latents") if hasattr(item, "get") else item
        name = f"item {i}" + (f" (sample {item['index']})" if hasattr(item, "get") and "index" in item else "")
        if not isinstance(latents, torch.Tensor) or latents.dim() < 3:
            raise ValueError(f"collate_packed: {name} has no latents tensor [C, T, H, W]; got "
                             f"{type(latents).__name__}{list(latents.shape) if isinstance(latents, torch.Tensor) else ''}")
        shapes.append(tuple(latents.shape[-3:]))
    shapes = np.asarray(shapes, dtype=np.int64)
    try:
        seq = np.atleast_1d(tokens_from_latent(shapes, patch_size=patch_size))
    except ValueError:
        bad = int(np.flatnonzero(np.any(shapes % np.asarray(patch_size) != 0, axis=1))[0])
        raise ValueError(f"collate_packed: item {bad} has latent shape {shapes[bad].tolist()}, not a multiple of "
                         f"the patch size {tuple(patch_size)}") from None
    cu = np.concatenate([[0], np.cumsum(seq)])
    return PackedBatch(list(samples), torch.from_numpy(shapes), torch.from_numpy(cu.astype(np.int32)),
                       torch.from_numpy(np.repeat(np.arange(seq.size, dtype=np.int32), seq)), int(seq.max()))


def sampler_from_plan(plan, shapes_or_seq_lens, num_replicas=None, rank=None, seed: int = 0) -> EpochBatchSampler:
    """The batch sampler of a plan's policy: :class:`PackingSampler` for ``packed``, else
    :class:`~adaptiveload.sched.sampler.DualConstraintBucketSampler` with the policy's step order
    (both with the plan's budgets, cost model, ``drop_oversized`` and patch size).

    Raises:
        ValueError: as the sampler's constructor.

    Example::

        >>> from adaptiveload.sched.manifest import reference_mix
        >>> from adaptiveload.sched.plan import make_plan
        >>> from adaptiveload.sched.presets import load_calibration
        >>> corpus = reference_mix(3000)
        >>> plan = make_plan(corpus, load_calibration("anchors-wan1.3b"), 2, m_mem=151200, policy="packed")
        >>> type(sampler_from_plan(plan, corpus.latent_shapes, num_replicas=2, rank=0)).__name__
        'PackingSampler'
    """
    if plan.policy == POLICY:
        return PackingSampler.from_plan(plan, shapes_or_seq_lens, num_replicas=num_replicas, rank=rank, seed=seed)
    return DualConstraintBucketSampler.from_plan(plan, shapes_or_seq_lens, num_replicas=num_replicas, rank=rank, seed=seed)
