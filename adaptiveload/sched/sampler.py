"""``DualConstraintBucketSampler``: a distributed batch sampler with per-bucket batch sizes.

Modelled on ``torch.utils.data.DistributedSampler``: rank and world size default from
``torch.distributed``, every rank computes the same epoch plan from ``(seed, epoch)`` with a local
generator and no communication, and every rank gets the same number of steps. The generator is a
numpy ``PCG64`` seeded with the sequence ``(seed, epoch)`` rather than a ``torch.Generator`` seeded
with ``seed + epoch``: the plan is built with numpy arrays, and ``(0, 1)`` and ``(1, 0)`` stay distinct.

Batch sizes and budgets are **per rank** (per GPU); one global step trains W batches, one per rank,
possibly of different shapes and sizes.

Epoch plan (vectorised numpy; 10M samples in about a second, see ``benchmarks/bench_planner.py``):

1. samples are grouped by bucket (one latent shape, or one sequence length) and shuffled within it;
2. each bucket is cut into batches of its batch size ``B_k``; the last batch of a bucket is smaller
   (``drop_last=False``) or dropped (``drop_last=True``);
3. the batch count is made a multiple of the world size W: ``drop_last=False`` repeats randomly
   chosen whole batches (their samples are seen twice this epoch), ``drop_last=True`` drops randomly
   chosen batches; so each sample is used exactly once per epoch except for those repeats/drops;
4. batches are assigned to global steps, one per rank per step, by the step order (the sampler's
   ``policy`` argument; not a batching policy of :mod:`adaptiveload.sched.policies`, whose
   :func:`~adaptiveload.sched.policies.step_order` gives the step order each uses):

   * ``"random"`` -- batches in random order, W per step: each rank draws an independent random batch
     (as Open-Sora does), so ranks' step costs differ and all wait for the slowest;
   * ``"cost_grouped"`` -- batches sorted by predicted cost, W consecutive ones form a step, then the
     steps are shuffled. Ranks' costs in a step are nearly equal (little idle time). **Data-order
     effect**: batches of similar cost are mostly batches of the same bucket, so each global step
     sees one or a few shapes (e.g. all ranks on 81-frame 720p clips, or all on images) instead of
     a mix, and the order of buckets over the epoch is random per step rather than per sample. The
     set of samples per epoch is unchanged; the per-step gradient mixes fewer shapes.

Resume (exact, with DataLoader workers prefetching ahead): the sampler cannot know how many of the
batches it yielded were trained on, so the training loop passes the number of steps it completed in
this epoch to :meth:`~DualConstraintBucketSampler.state_dict`::

    sampler.set_epoch(epoch)
    for step, batch in enumerate(loader, start=sampler.resume_step):
        train_step(batch)
        checkpoint["sampler"] = sampler.state_dict(consumed_steps=step + 1)

    # later, in a new process: restore, then run the same loop; set_epoch(restored epoch) keeps the
    # resume point, so the next iteration starts at step consumed_steps and enumerate counts from it
    sampler.load_state_dict(checkpoint["sampler"])

``consumed_steps`` counts from the start of the epoch. The resume point is used by the next iteration
that starts, then cleared; a ``set_epoch`` to another epoch clears it too.
"""
from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from adaptiveload.sched.batch_size import dual_constraint_batch_size, equal_token_batch_size, oversized_buckets
from adaptiveload.sched.cost_model import CostModel
from adaptiveload.sched.policies import STEP_ORDERS, step_order
from adaptiveload.sched.shapes import tokens_from_latent

logger = logging.getLogger("adaptiveload.sched")

STATE_VERSION = 1


@dataclass
class EpochPlan:
    """Which batch every rank trains on at every step of one epoch, without loading data.

    Attributes:
        step_batches: int64 [steps, world_size], the batch id rank r trains on at step s.
        batch_bucket: int64 [num_batches], bucket of each batch.
        batch_size: int64 [num_batches], samples in each batch.
        batch_start: int64 [num_batches], offset of each batch in ``order``.
        order: int64 [num_samples_kept], sample indices grouped by batch.
        bucket_keys: int64 [num_buckets, 3 or 1], latent shape (or sequence length) of each bucket.
        bucket_seq_lens: int64 [num_buckets], tokens per sample of each bucket.
    """

    step_batches: np.ndarray
    batch_bucket: np.ndarray
    batch_size: np.ndarray
    batch_start: np.ndarray
    order: np.ndarray
    bucket_keys: np.ndarray
    bucket_seq_lens: np.ndarray

    @property
    def num_steps(self) -> int:
        """Global steps in the epoch (the same on every rank)."""
        return int(self.step_batches.shape[0])

    def indices(self, batch_id: int) -> np.ndarray:
        """Sample indices (int64 [batch_size]) of one batch."""
        start = self.batch_start[batch_id]
        return self.order[start:start + self.batch_size[batch_id]]

    def step_seq_lens(self) -> np.ndarray:
        """int64 [steps, world_size]: tokens per sample of each rank's batch."""
        return self.bucket_seq_lens[self.batch_bucket[self.step_batches]]

    def step_batch_sizes(self) -> np.ndarray:
        """int64 [steps, world_size]: samples in each rank's batch."""
        return self.batch_size[self.step_batches]

    def step_costs(self, cost_model: CostModel) -> np.ndarray:
        """float64 [steps, world_size]: predicted seconds of each rank's batch."""
        return cost_model.predict(self.step_batch_sizes(), self.step_seq_lens())

    def step_tokens(self) -> np.ndarray:
        """int64 [steps, world_size]: tokens each rank trains at each step."""
        return self.step_batch_sizes() * self.step_seq_lens()

    def step_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """``(step, sample)``: int64 arrays, the global step of every sample trained (a repeated
        batch's samples once more)."""
        ids = self.step_batches.reshape(-1)
        lengths = self.batch_size[ids]
        offsets = np.repeat(self.batch_start[ids] - (np.cumsum(lengths) - lengths), lengths)
        step = np.repeat(np.arange(ids.size) // self.step_batches.shape[1], lengths)
        return step, self.order[offsets + np.arange(int(lengths.sum()))].astype(np.int64)

    def sample_counts(self, num_samples: int) -> np.ndarray:
        """int64 [num_samples]: how often each sample is used this epoch (1 except drops/repeats)."""
        return np.bincount(self.step_samples()[1], minlength=num_samples)


def group_buckets(shapes_or_seq_lens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group samples into buckets (one per distinct latent shape or sequence length).

    Args:
        shapes_or_seq_lens: int array [n, 3] of latent (T, H, W), or [n] of sequence lengths.

    Returns:
        ``(bucket_keys, inverse, counts)``: int64 [k, 3 or 1] sorted distinct keys, int64 [n] bucket of
        each sample, int64 [k] samples per bucket.

    Raises:
        ValueError: empty, wrong shape, non-integral or non-positive values (first bad sample named).
    """
    keys = np.asarray(shapes_or_seq_lens)
    if keys.ndim == 1:
        keys = keys[:, None]
    if keys.ndim != 2 or keys.shape[1] not in (1, 3) or keys.shape[0] == 0:
        raise ValueError(f"shapes_or_seq_lens must be a non-empty [n, 3] (latent T, H, W) or [n] (tokens) array, "
                         f"got shape {list(np.shape(shapes_or_seq_lens))}")
    if not np.issubdtype(keys.dtype, np.integer):
        if not (np.issubdtype(keys.dtype, np.floating) and np.all(keys == np.floor(keys))):
            raise ValueError(f"shapes_or_seq_lens must hold integers, got dtype {keys.dtype}")
    keys = keys.astype(np.int64)
    bad = np.flatnonzero(np.any(keys < 1, axis=1))
    if bad.size:
        raise ValueError(f"shapes_or_seq_lens must be positive, got {keys[bad[0]].tolist()} at sample {int(bad[0])}")
    # Dense codes per column, then per combination: O(n) with bincount, in the lexicographic order of
    # np.unique(keys, axis=0) (which sorts, ~10x slower on 10M rows).
    code, uniq_cols = np.zeros(len(keys), dtype=np.int64), []
    for j in range(keys.shape[1]):
        uniq, col_code = _dense_codes(keys[:, j])
        code = code * len(uniq) + col_code
        uniq_cols.append(uniq)
    combos, inverse = _dense_codes(code)
    counts = np.bincount(inverse, minlength=len(combos)).astype(np.int64)
    bucket_keys = np.empty((len(combos), keys.shape[1]), dtype=np.int64)
    for j in reversed(range(keys.shape[1])):
        combos, digit = np.divmod(combos, len(uniq_cols[j]))
        bucket_keys[:, j] = uniq_cols[j][digit]
    return bucket_keys, inverse, counts


# Above this value a bincount table would be too large: fall back to sorting.
_DENSE_TABLE_MAX = 1 << 24


def _dense_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values of a non-negative int64 array and each element's index among them."""
    top = int(values.max())
    if top >= _DENSE_TABLE_MAX:
        uniq, inverse = np.unique(values, return_inverse=True)
        return uniq, inverse.reshape(-1).astype(np.int64)
    uniq = np.flatnonzero(np.bincount(values, minlength=top + 1))
    table = np.zeros(top + 1, dtype=np.int64)
    table[uniq] = np.arange(len(uniq))
    return uniq.astype(np.int64), table[values]


def bucket_tokens(bucket_keys: np.ndarray, patch_size=(1, 2, 2)) -> np.ndarray:
    """Sequence length (int64 [k]) of bucket keys from :func:`group_buckets`."""
    if bucket_keys.shape[1] == 3:
        return tokens_from_latent(bucket_keys, patch_size=patch_size).astype(np.int64)
    return bucket_keys[:, 0].copy()


def _dist_default(num_replicas, rank) -> tuple[int, int]:
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"Invalid num_replicas {num_replicas!r}, num_replicas should be a positive integer")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank!r}, rank should be in the interval [0, {num_replicas - 1}]")
    return int(num_replicas), int(rank)


class EpochBatchSampler(torch.utils.data.Sampler, ABC):
    """What every epoch-planned batch sampler of this package shares: ``set_epoch``, an exact
    ``len()``, and exact mid-epoch resume with ``state_dict(consumed_steps=k)`` (module docstring).

    A subclass sets ``num_replicas``, ``rank``, ``seed``, ``policy`` and calls :meth:`_init_epochs`;
    it implements :meth:`steps_per_epoch`, ``_epoch_batches(start)`` (the lists of sample indices
    this rank trains from global step ``start`` of ``self.epoch``) and ``_plan_inputs()`` (the arrays
    and values that decide the plan besides the world size, seed, policy and epoch; a state from
    another plan does not load).
    """

    num_replicas: int
    rank: int
    seed: int
    policy: str

    def _init_epochs(self) -> None:
        self.epoch = 0
        self._resume_step = 0

    @abstractmethod
    def steps_per_epoch(self) -> int:
        """Global steps (= batches per rank) in one epoch."""

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next iteration yields (call before each epoch, on every rank).

        A resume point restored by :meth:`load_state_dict` is kept when ``epoch`` is the restored
        epoch and discarded otherwise.
        """
        if int(epoch) != self.epoch:
            self._resume_step = 0
        self.epoch = int(epoch)

    @property
    def resume_step(self) -> int:
        """Step of the current epoch the next iteration starts at (0 unless resumed).

        A restored resume point is used by the next iteration that starts (its first ``next()``);
        read it before iterating, e.g. ``enumerate(loader, start=sampler.resume_step)``.
        """
        return self._resume_step

    def __len__(self) -> int:
        """Batches the next iteration yields on this rank: steps per epoch minus the resume step."""
        return self.steps_per_epoch() - self._resume_step

    def __iter__(self):
        # A generator: the body runs at the first next(), so an iterator that is created and dropped
        # (DataLoader creates one in __init__ and another in _reset) does not use up the resume point.
        start, self._resume_step = self._resume_step, 0
        yield from self._epoch_batches(start)

    @abstractmethod
    def _epoch_batches(self, start: int):
        """Lists of sample indices this rank trains from global step ``start`` of ``self.epoch``."""

    @abstractmethod
    def _plan_inputs(self) -> tuple[tuple, tuple]:
        """What decides the plan besides world size, seed, policy and epoch: ``(arrays, values)``."""

    def _fingerprint(self) -> str:
        arrays, values = self._plan_inputs()
        h = hashlib.sha1()
        for arr in arrays:
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update(repr((self.num_replicas, self.seed, self.policy, *values)).encode())
        return h.hexdigest()

    def state_dict(self, consumed_steps: int) -> dict:
        """Resume state after ``consumed_steps`` steps of the current epoch were trained.

        Args:
            consumed_steps: global steps of the current epoch completed by training, counted from the
                start of the epoch (including steps before an earlier resume); not the batches the
                DataLoader has fetched ahead.

        Returns:
            A small dict (plain Python values) for the training checkpoint.

        Raises:
            ValueError: ``consumed_steps`` outside ``[0, steps_per_epoch()]``.
        """
        steps = self.steps_per_epoch()
        if not 0 <= int(consumed_steps) <= steps:
            raise ValueError(f"Invalid consumed_steps {consumed_steps}, it should be in the interval [0, {steps}]")
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed_steps": int(consumed_steps),
                "steps_per_epoch": steps, "seed": self.seed, "num_replicas": self.num_replicas,
                "policy": self.policy, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`: the next iteration yields epoch ``state["epoch"]`` from step
        ``state["consumed_steps"]``.

        Raises:
            ValueError: a missing field, or a state from a different dataset, batch-size or packing
                rule, world size, seed, policy or drop_last (resuming would not replay the same batches).
        """
        for key in ("version", "epoch", "consumed_steps", "num_replicas", "seed", "policy", "fingerprint"):
            if key not in state:
                raise ValueError(f"sampler state: missing field '{key}'")
        for key, mine in (("num_replicas", self.num_replicas), ("seed", self.seed), ("policy", self.policy)):
            if state[key] != mine:
                raise ValueError(f"sampler state: {key} was {state[key]!r}, this sampler has {mine!r}; "
                                 f"an exact resume needs the same value")
        if state["fingerprint"] != self._fingerprint():
            raise ValueError("sampler state: made for a different dataset, batch-size rule or drop_last "
                             "(fingerprint mismatch); an exact resume needs the same ones")
        self.epoch = int(state["epoch"])
        steps = self.steps_per_epoch()
        if not 0 <= int(state["consumed_steps"]) <= steps:
            raise ValueError(f"sampler state: consumed_steps {state['consumed_steps']} outside [0, {steps}]")
        self._resume_step = int(state["consumed_steps"])


class DualConstraintBucketSampler(EpochBatchSampler):
    """Distributed batch sampler: one shape per batch, per-bucket batch sizes under memory and compute budgets.

    Use as ``DataLoader(dataset, batch_sampler=sampler, num_workers=...)``; it yields lists of sample
    indices, one batch per step on this rank.

    Args:
        shapes_or_seq_lens: int array [n, 3] of latent shapes (T, H, W) -- one bucket per distinct
            shape -- or [n] of sequence lengths when every S maps to one shape (one bucket per S).
            Tokens are ``T*H*W / prod(patch_size)``.
        m_mem: memory budget, tokens per batch: ``B*S <= m_mem``.
        m_comp, p: the paper's compute budget ``B*S^p <= m_comp`` (give both, or neither).
        num_replicas: world size W; default ``torch.distributed.get_world_size()`` (1 if not initialised).
        rank: this rank; default ``torch.distributed.get_rank()`` (0 if not initialised).
        seed: epoch plans depend only on ``(seed, epoch)``; must be equal on all ranks.
        policy: the step order, ``"random"`` or ``"cost_grouped"`` (see the module docstring) -- not
            a batching policy name (``equal_token`` / ``dual`` / ``cost_grouped``, which
            :meth:`from_plan` maps with :func:`~adaptiveload.sched.policies.step_order`).
        drop_last: drop each bucket's partial batch and drop batches to a multiple of W, instead of
            keeping partial batches and repeating whole batches to a multiple of W.
        cost_model: fitted step-time model; orders batches for ``"cost_grouped"``, and with
            ``step_budget_s`` gives the compute constraint ``cost_model.predict(B, S) <= step_budget_s``
            (the general form; for the power model it equals ``B*S^p <= (budget - a)/b``).
            Without it, ``"cost_grouped"`` orders by ``B*S^p``.
        step_budget_s: step-time budget in seconds (needs ``cost_model``; exclusive with ``m_comp``).
        drop_oversized: exclude buckets with ``S > m_mem`` (one sample over the memory budget)
            instead of raising.
        patch_size: DiT patch (pt, ph, pw), to turn latent shapes into tokens.

    Without ``m_comp`` and ``step_budget_s`` the rule is equal-token: ``B = floor(m_mem / S)``.

    Raises:
        ValueError: empty or malformed shapes, a bad budget, an unknown policy, an invalid rank,
            ``cost_grouped`` with neither ``cost_model`` nor ``p``, or buckets over ``m_mem`` (listed)
            without ``drop_oversized``.

    Example::

        >>> s = DualConstraintBucketSampler([1560] * 5 + [32760] * 3, m_mem=65520, num_replicas=2, rank=0)
        >>> s.bucket_batch_sizes.tolist(), len(s)
        ([42, 2], 2)
    """

    def __init__(
        self,
        shapes_or_seq_lens,
        m_mem,
        m_comp=None,
        p=None,
        num_replicas=None,
        rank=None,
        seed: int = 0,
        policy: str = "random",
        drop_last: bool = False,
        cost_model: CostModel | None = None,
        *,
        step_budget_s: float | None = None,
        drop_oversized: bool = False,
        patch_size=(1, 2, 2),
    ):
        self.num_replicas, self.rank = _dist_default(num_replicas, rank)
        if policy not in STEP_ORDERS:
            raise ValueError(f"Invalid policy {policy!r}: the sampler's policy is its step order, one of {STEP_ORDERS}")
        if m_comp is not None and p is None:
            raise ValueError("m_comp needs the exponent p (the compute constraint is B*S^p <= m_comp)")
        if m_comp is not None and step_budget_s is not None:
            raise ValueError("give either m_comp (with p) or step_budget_s (with cost_model), not both")
        if step_budget_s is not None and cost_model is None:
            raise ValueError("step_budget_s needs cost_model (the constraint is cost_model.predict(B, S) <= step_budget_s)")
        if policy == "cost_grouped" and cost_model is None and p is None:
            raise ValueError("policy 'cost_grouped' needs a cost_model or the exponent p to order batches by cost")
        self.seed, self.policy, self.drop_last = int(seed), policy, bool(drop_last)
        self.m_mem, self.m_comp, self.p = m_mem, m_comp, p
        self.cost_model, self.step_budget_s = cost_model, step_budget_s
        self._init_epochs()

        bucket_keys, inverse, counts = group_buckets(shapes_or_seq_lens)
        self.num_samples = int(inverse.shape[0])
        bucket_seq_lens = bucket_tokens(bucket_keys, patch_size)
        self._sample_bucket = inverse.astype(np.int16 if len(bucket_keys) < 2**15 else np.int32)
        # sample indices grouped by bucket (numpy's stable sort of 16-bit ints is a radix sort);
        # each epoch only shuffles within these segments
        index_dtype = np.int32 if self.num_samples < 2**31 else np.int64
        self._bucket_order = np.argsort(self._sample_bucket, kind="stable").astype(index_dtype)
        self.bucket_keys, self.bucket_seq_lens = bucket_keys, bucket_seq_lens
        self.bucket_counts = counts

        self.bucket_batch_sizes = self._batch_sizes(bucket_seq_lens)
        over = oversized_buckets(bucket_seq_lens, m_mem)
        self.dropped_buckets = np.zeros(0, dtype=np.int64)
        if over.size:
            names = ", ".join(f"{self._bucket_name(k)} (S={int(bucket_seq_lens[k])}, {int(self.bucket_counts[k])} samples)" for k in over)
            if not drop_oversized:
                raise ValueError(f"bucket(s) with one sample over m_mem={m_mem} tokens: {names}; "
                                 f"raise the memory budget (m_mem; --m-mem or --memory-budget-gb on the command line) or drop them "
                                 f"(drop_oversized=True; --drop-oversized)")
            logger.warning("dropping bucket(s) over m_mem=%s tokens: %s", m_mem, names)
            self.dropped_buckets = over
            self.bucket_batch_sizes[over] = 0

    # ------------------------------------------------------------------------------ construction

    @classmethod
    def from_plan(cls, plan, shapes_or_seq_lens, num_replicas=None, rank=None, seed: int = 0, policy=None,
                  drop_last: bool = False):
        """A sampler with the batch-size rule of a :class:`~adaptiveload.sched.plan.Plan`.

        Uses the plan's ``m_mem``, step budget, cost model and ``drop_oversized``, and the step order
        of its policy (``step_order(plan.policy)``: ``"cost_grouped"`` for ``cost_grouped``, else
        ``"random"``) unless ``policy`` (a step order) is given. Logs a warning when the world size
        differs from the one planned for.

        Raises:
            ValueError: as the constructor; an unknown plan policy.
        """
        sampler = cls(shapes_or_seq_lens, plan.m_mem, num_replicas=num_replicas, rank=rank, seed=seed,
                      policy=policy or step_order(plan.policy), drop_last=drop_last, cost_model=plan.cost_model,
                      step_budget_s=plan.step_budget_s, drop_oversized=plan.drop_oversized,
                      patch_size=plan.patch_size)
        if sampler.num_replicas != plan.world_size:
            logger.warning("plan was made for world size %d, sampler runs with %d: the budget may no longer be the best",
                           plan.world_size, sampler.num_replicas)
        return sampler

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        if self.m_comp is not None:
            b = dual_constraint_batch_size(seq_lens, self.m_mem, self.m_comp, self.p)
        else:
            b = equal_token_batch_size(seq_lens, self.m_mem)
        if self.step_budget_s is not None:
            b = np.maximum(1, np.minimum(b, self.cost_model.max_batch_size(seq_lens, self.step_budget_s)))
        return np.asarray(b, dtype=np.int64).reshape(-1)

    def _bucket_name(self, k: int) -> str:
        key = self.bucket_keys[k]
        return f"latent {tuple(int(v) for v in key)}" if key.size == 3 else f"S={int(key[0])}"

    def batch_cost(self, batch_sizes, seq_lens) -> np.ndarray:
        """Predicted cost used by ``cost_grouped``: seconds with a cost model, else ``B*S^p``."""
        if self.cost_model is not None:
            return self.cost_model.predict(batch_sizes, seq_lens)
        return np.asarray(batch_sizes, dtype=np.float64) * np.power(np.asarray(seq_lens, dtype=np.float64), self.p)

    # ------------------------------------------------------------------------------ epoch plan

    def _batch_counts(self) -> tuple[np.ndarray, int]:
        """Batches per bucket and the total after rounding to a multiple of the world size."""
        b = np.maximum(self.bucket_batch_sizes, 1)
        full, rest = np.divmod(self.bucket_counts, b)
        per_bucket = np.where(self.bucket_batch_sizes > 0, full + ((rest > 0) & (not self.drop_last)), 0)
        total = int(per_bucket.sum())
        w = self.num_replicas
        total = (total // w) * w if self.drop_last else -(-total // w) * w
        return per_bucket, total

    def steps_per_epoch(self) -> int:
        """Global steps (= batches per rank) in one epoch."""
        return self._batch_counts()[1] // self.num_replicas

    def batch_kinds(self) -> np.ndarray:
        """int64 [n, 2]: every distinct (bucket, batch size) an epoch's batches can take, on any rank,
        sorted by bucket then batch size.

        A bucket yields full batches of its batch size and, unless ``drop_last``, one partial batch
        of the remainder (only that one when the bucket holds fewer samples than its batch size);
        a dropped bucket yields none. The pairs are the same every epoch: rounding to a multiple of
        the world size repeats or drops whole batches.
        """
        sizes = self.bucket_batch_sizes
        full, rest = np.divmod(self.bucket_counts, np.maximum(sizes, 1))
        buckets = np.arange(len(sizes))
        has_full = (sizes > 0) & (full > 0)
        has_rest = (sizes > 0) & (rest > 0) & (not self.drop_last)
        kinds = np.concatenate([np.stack([buckets[has_full], sizes[has_full]], axis=1),
                                np.stack([buckets[has_rest], rest[has_rest]], axis=1)]).astype(np.int64)
        return kinds[np.lexsort((kinds[:, 1], kinds[:, 0]))]

    def epoch_plan(self, epoch: int | None = None) -> EpochPlan:
        """The full plan of ``epoch`` (default: the current one) for all ranks; identical on every rank."""
        epoch = self.epoch if epoch is None else int(epoch)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        # 1. shuffle within each bucket
        bucket_start = np.concatenate([[0], np.cumsum(self.bucket_counts)[:-1]])
        order = np.empty_like(self._bucket_order)
        for start, count in zip(bucket_start.tolist(), self.bucket_counts.tolist()):
            order[start:start + count] = self._bucket_order[start:start + count][rng.permutation(count)]
        # 2. cut buckets into batches
        per_bucket, total = self._batch_counts()
        num_batches = int(per_bucket.sum())
        batch_bucket = np.repeat(np.arange(len(per_bucket)), per_bucket)
        first_batch = np.concatenate([[0], np.cumsum(per_bucket)[:-1]])
        within = np.arange(num_batches) - first_batch[batch_bucket]
        bs = self.bucket_batch_sizes[batch_bucket]
        batch_start = bucket_start[batch_bucket] + within * bs
        batch_size = np.minimum(bs, self.bucket_counts[batch_bucket] - within * bs)
        # 3. round to a multiple of the world size
        if total < num_batches:
            batch_ids = np.sort(rng.choice(num_batches, size=total, replace=False))
        elif total > num_batches:
            extra = total - num_batches
            repeats = rng.choice(num_batches, size=extra, replace=extra > num_batches)
            batch_ids = np.concatenate([np.arange(num_batches), repeats])
        else:
            batch_ids = np.arange(num_batches)
        # 4. assign batches to steps
        batch_ids = batch_ids[rng.permutation(batch_ids.size)]
        if self.policy == "cost_grouped" and batch_ids.size:
            # sort by cost through the batch type (bucket, full or partial): a radix sort of small ints
            num_buckets = len(self.bucket_seq_lens)
            batch_type = batch_bucket + num_buckets * (batch_size != self.bucket_batch_sizes[batch_bucket])
            type_size = np.concatenate([self.bucket_batch_sizes, self.bucket_counts % np.maximum(self.bucket_batch_sizes, 1)])
            type_cost = self.batch_cost(np.maximum(type_size, 1), np.tile(self.bucket_seq_lens, 2))
            type_rank = np.empty(2 * num_buckets, dtype=np.int64)
            type_rank[np.argsort(type_cost, kind="stable")] = np.arange(2 * num_buckets)
            key = type_rank[batch_type[batch_ids]].astype(np.int16 if 2 * num_buckets < 2**15 else np.int32)
            batch_ids = batch_ids[np.argsort(key, kind="stable")]
            steps = batch_ids.reshape(-1, self.num_replicas)
            steps = steps[rng.permutation(steps.shape[0])]
        else:
            steps = batch_ids.reshape(-1, self.num_replicas)
        return EpochPlan(steps, batch_bucket, batch_size, batch_start, order, self.bucket_keys, self.bucket_seq_lens)

    # ------------------------------------------------------------------------------ EpochBatchSampler hooks

    def _epoch_batches(self, start: int):
        plan = self.epoch_plan(self.epoch)
        for batch_id in plan.step_batches[start:, self.rank]:
            yield plan.indices(batch_id).tolist()

    def _plan_inputs(self) -> tuple[tuple, tuple]:
        return (self._sample_bucket, self.bucket_keys, self.bucket_batch_sizes), (self.drop_last,)
