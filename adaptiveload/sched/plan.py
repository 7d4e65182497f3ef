"""Planning: choose the memory and compute budgets that maximise predicted tokens/s on a corpus.

The batch-size rule (the sampler's): ``B_k = max(1, min(floor(M_mem / S_k), B_cost(S_k, C)))`` where
``B_cost`` is the largest B whose predicted step time is ``<= C`` under the calibration's cost model.
:func:`make_plan` evaluates every budget at which some bucket's batch size changes (the exact
breakpoints ``C = t(b, S_k)``), for several ``M_mem`` up to the memory limit, and keeps the one with
the highest predicted throughput for the world size and the step order of the policy
(:mod:`adaptiveload.sched.policies`):

* ``"random"`` (policies ``dual`` and ``equal_token``: ranks draw batches independently): a step lasts
  as long as the slowest of W independent draws from the epoch's batch mix,
  ``E[max] = sum_j c_j (F_j^W - F_{j-1}^W)`` over batch types sorted by cost c_j with cumulative share
  F_j; tokens/s = ``W * E[tokens] / E[max]``;
* ``"cost_grouped"`` (policy ``cost_grouped``: W consecutive batches in cost order form a step): the
  step time is the most expensive batch of each group of W, summed exactly over the sorted batch list.

Policy ``equal_token`` searches nothing: its plan is the equal-token rule ``B = floor(M_mem_limit / S)``
(``M_mem`` = the memory limit, no step budget). The equal-token rule (ranks drawing independently) is
reported next to every plan for comparison.

Policy ``packed`` (:class:`~adaptiveload.sched.packing.PackingSampler`): ``M_mem`` is the memory limit
per rank (fewer tokens per pack would only take choices from the packer), and the step budget -- each
pack's predicted time -- is searched over :data:`PACKED_BUDGETS` values between a fraction of the
longest sample's time and a bit above the time of a pack filled to the limit with the corpus's mix,
and the time of a pack of the longest sample alone (the smallest budget every pack can reach; often
the best, as the packs of the longest samples then need no other sample to reach it).
Each budget is scored by packing an epoch of (at most :data:`PACKED_PLAN_SAMPLES` of) the corpus's
samples with the packer itself: tokens / sum over steps of the slowest rank's predicted time, over
the steps in which every rank has a pack (:func:`packed_throughput`). Among
the budgets within :data:`PACKED_TIE` of the best score -- differences the cost model does not
resolve -- the plan keeps the one whose steps are closest to random samples (the lowest
``composition_ks`` of :func:`~adaptiveload.sched.metrics.composition`): a budget below the longest
sample's time, or one that fills packs to the memory limit before they reach it, leaves packs whose
time stands out, and the packer must group those into steps of their own.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field

import numpy as np

from adaptiveload.jsonfile import check_header, read_json, write_json_atomic
from adaptiveload.sched.calibration import Calibration
from adaptiveload.sched.cost_model import CostModel, PowerCostModel
from adaptiveload.sched.manifest import Manifest
from adaptiveload.sched.metrics import composition
from adaptiveload.sched.packing import PackingSampler
from adaptiveload.sched.policies import policy_name, step_order
from adaptiveload.sched.sampler import bucket_tokens, group_buckets
from adaptiveload.sched.shapes import WAN_VAE_STRIDE

FORMAT = "adaptiveload.plan"
FORMAT_VERSION = 1
DEFAULT_SAFETY = 0.9  # plan for 90% of the memory budget (fragmentation, allocator cache)
M_MEM_CANDIDATES = 8  # memory budgets tried between the longest sample and the memory limit
MAX_BUDGET_CANDIDATES = 4000  # compute-budget breakpoints evaluated per memory budget (subsampled above)
PACKED_BUDGETS = 16  # step budgets tried for policy packed
PACKED_PLAN_SAMPLES = 200_000  # samples a packed budget is scored on (a seeded random subset of a larger corpus)
PACKED_TIE = 0.01  # packed budgets scoring within this share of the best are ties (the most random steps win)
MEMORY_SOURCES = ("m_mem", "memory_budget", "device", "largest_batch")


def batch_mix(counts: np.ndarray, batch_sizes: np.ndarray):
    """Batch types of one epoch: full batches and each bucket's partial last batch.

    Args:
        counts: int64 [k] samples per bucket; batch_sizes: int64 [k] (0 = bucket dropped).

    Returns:
        ``(bucket, size, multiplicity)``: int64 arrays [m] of batch types.
    """
    b = np.maximum(batch_sizes, 1)
    full, rest = np.divmod(counts, b)
    keep = batch_sizes > 0
    bucket = np.concatenate([np.flatnonzero(keep), np.flatnonzero(keep & (rest > 0))])
    size = np.concatenate([batch_sizes[keep], rest[keep & (rest > 0)]])
    mult = np.concatenate([full[keep], np.ones(int(np.sum(keep & (rest > 0))), dtype=np.int64)])
    nz = mult > 0
    return bucket[nz], size[nz], mult[nz]


def predicted_throughput(cost_model: CostModel, seq_lens, counts, batch_sizes, world_size: int, policy: str) -> dict:
    """Predicted tokens/s and step time of an epoch with these per-bucket batch sizes.

    Args:
        cost_model: step-time model (seconds).
        seq_lens, counts, batch_sizes: int arrays [k] per bucket (batch size 0 = dropped).
        world_size: W ranks, one batch each per step.
        policy: a policy (``equal_token``, ``dual``, ``cost_grouped`` or an older spelling) or a step
            order (``"random"``, ``"cost_grouped"``); its step order picks the formula (module docstring).

    Returns:
        dict with ``tokens_per_s``, ``step_time_s`` (expected step time = slowest rank),
        ``mean_batch_time_s`` (mean rank time) and ``idle`` (``1 - mean/step``).
    """
    bucket, size, mult = batch_mix(np.asarray(counts), np.asarray(batch_sizes))
    s = np.asarray(seq_lens, dtype=np.float64)[bucket]
    cost = cost_model.predict(size, s)
    tokens = size * s
    order = np.argsort(cost, kind="stable")
    cost, tokens, mult = cost[order], tokens[order], mult[order].astype(np.float64)
    total = float(mult.sum())
    mean_cost = float(np.sum(cost * mult) / total)
    if step_order(policy) == "random":
        cdf = np.cumsum(mult) / total
        prev = np.concatenate([[0.0], cdf[:-1]])
        step = float(np.sum(cost * (cdf**world_size - prev**world_size)))
        tps = world_size * float(np.sum(tokens * mult) / total) / step
    else:
        end = np.cumsum(mult)
        start = end - mult
        tops = np.floor(end / world_size) - np.floor(start / world_size)  # group maxima in each run
        num_steps = math.ceil(total / world_size)
        step_sum = float(np.sum(cost * tops)) + (cost[-1] if total % world_size else 0.0)
        step = step_sum / num_steps
        tps = float(np.sum(tokens * mult)) / step_sum
    return {"tokens_per_s": tps, "step_time_s": step, "mean_batch_time_s": mean_cost, "idle": 1.0 - mean_cost / step}


def packed_throughput(cost_model: CostModel, shapes_or_seq_lens, m_mem: int, step_budget_s: float, world_size: int,
                      *, patch_size=(1, 2, 2)) -> dict:
    """Predicted tokens/s and step time of policy ``packed``: the packs of one epoch (seed 0) of these
    samples, timed by ``cost_model``.

    Args:
        cost_model: step-time model (seconds); shapes_or_seq_lens: the samples, as
            :class:`~adaptiveload.sched.packing.PackingSampler` takes them (none longer than ``m_mem``).
        m_mem, step_budget_s: the packer's tokens and predicted seconds per pack; world_size: ranks W.

    Returns:
        dict as :func:`predicted_throughput`: ``tokens_per_s`` (tokens / sum of the slowest rank's time
        per step), ``step_time_s``, ``mean_batch_time_s`` (mean rank time) and ``idle``
        (``1 - mean/step``), over the steps in which every rank trains a pack (all steps when none
        is: the epoch's last step, partly padding, is one step of an epoch whatever its length, and
        would weigh more on a subset of the corpus than in the epoch); and ``composition_ks``
        (:func:`~adaptiveload.sched.metrics.composition` of all the epoch's steps).
    """
    packing = PackingSampler(shapes_or_seq_lens, m_mem, step_budget_s, cost_model, num_replicas=world_size, rank=0,
                             patch_size=patch_size).epoch_plan(0)
    full = (packing.step_packs >= 0).all(axis=1)
    if not full.any():
        full[:] = True
    costs = packing.step_costs(cost_model)[full]
    step = float(costs.max(axis=1).mean())
    mean = float(costs.mean())
    ks, _ = composition(*packing.step_samples(), packing.seq_lens)
    return {"tokens_per_s": float(packing.step_tokens()[full].sum()) / (step * costs.shape[0]), "step_time_s": step,
            "mean_batch_time_s": mean, "idle": 1.0 - mean / step, "composition_ks": ks}


def rule_batch_sizes(cost_model: CostModel, seq_lens, m_mem: int, step_budget_s: float | None) -> np.ndarray:
    """The sampler's rule: ``max(1, min(floor(m_mem / S), largest B with t(B, S) <= budget))`` (int64 [k])."""
    s = np.asarray(seq_lens, dtype=np.int64)
    b = m_mem // s
    if step_budget_s is not None:
        b = np.minimum(b, cost_model.max_batch_size(s, step_budget_s))
    return np.maximum(1, b).astype(np.int64)


@dataclass
class Plan:
    """A chosen batch-size rule for a corpus, a calibration and a world size.

    Attributes:
        world_size, policy: what it was optimised for; ``policy`` is one of
            :data:`~adaptiveload.sched.policies.POLICIES` (a plan file with an older spelling, e.g.
            ``"random"``, loads with the current name).
        m_mem: tokens per batch (memory constraint ``B*S <= m_mem``).
        m_mem_limit: the largest ``m_mem`` memory allows (from the memory model, or given).
        step_budget_s: compute constraint, predicted step seconds (``None`` = memory only).
        cost_model: the calibration's step-time model.
        buckets: per-bucket rows -- ``key`` (latent shape [T, H, W] or [S]), ``seq_len``,
            ``num_samples``, ``batch_size``, ``step_time_s`` (predicted, full batch), ``share_of_steps``
            (fraction of the epoch's batches), and the same for the equal-token rule
            (``equal_token_batch_size``, ``equal_token_step_time_s``, ``equal_token_share_of_steps``).
            Policy ``packed`` has no batch sizes: its rows give ``sample_time_s`` (the time one sample
            adds to a pack) and ``share_of_work`` (of the epoch's predicted time) instead of
            ``batch_size``, ``step_time_s`` and ``share_of_steps``.
        dropped: rows of buckets dropped as oversized (``key``, ``seq_len``, ``num_samples``).
        predicted: predicted ``tokens_per_s``, ``step_time_s``, ``idle`` of the plan and of equal-token,
            and ``speedup``.
        drop_oversized, patch_size, vae_stride: how the corpus was read (a plan file without
            ``vae_stride`` loads with Wan 2.1's 4x8x8).
        memory_source: where the memory limit came from, one of :data:`MEMORY_SOURCES` (``"m_mem"``
            given, ``"memory_budget"`` given, ``"device"`` the calibration's device memory,
            ``"largest_batch"`` the largest batch the calibration ran); ``""`` in older plan files.
        memory_budget_gib: the device memory the limit assumes, GiB (for a given ``m_mem``: the memory
            model's peak at that many tokens over the safety factor); ``None`` when unknown.
    """

    world_size: int
    policy: str
    m_mem: int
    m_mem_limit: int
    step_budget_s: float | None
    cost_model: CostModel
    buckets: list
    dropped: list = field(default_factory=list)
    predicted: dict = field(default_factory=dict)
    drop_oversized: bool = False
    patch_size: tuple = (1, 2, 2)
    source: str = ""
    date: str = ""
    vae_stride: tuple = WAN_VAE_STRIDE
    memory_source: str = ""
    memory_budget_gib: float | None = None

    @property
    def m_comp(self) -> float | None:
        """The paper's ``M_comp`` (units of ``S^p``) for a power cost model, else ``None``."""
        if isinstance(self.cost_model, PowerCostModel) and self.step_budget_s is not None:
            return self.cost_model.m_comp(self.step_budget_s)
        return None

    def to_json(self) -> dict:
        """The plan file's content: header, the rule (``m_mem``, ``step_budget_s``, ``m_comp``), the cost
        model, the predicted throughput and the bucket rows."""
        return {"format": FORMAT, "version": FORMAT_VERSION, "date": self.date, "source": self.source,
                "world_size": self.world_size, "policy": self.policy, "m_mem": self.m_mem,
                "m_mem_limit": self.m_mem_limit, "step_budget_s": self.step_budget_s, "m_comp": self.m_comp,
                "drop_oversized": self.drop_oversized, "patch_size": list(self.patch_size),
                "vae_stride": list(self.vae_stride), "memory_source": self.memory_source,
                "memory_budget_gib": self.memory_budget_gib,
                "cost_model": self.cost_model.to_json(), "predicted": self.predicted,
                "buckets": self.buckets, "dropped": self.dropped}

    def save(self, path) -> None:
        """Write the plan as JSON to ``path`` (atomically)."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, d: dict, *, where: str = "plan") -> "Plan":
        """Rebuild from :meth:`to_json` output (an older policy spelling loads as the current name).

        Raises:
            ValueError: not a plan, an unsupported version, a missing field, an unknown policy or cost
                model (messages start with ``where``).
        """
        check_header(d, fmt=FORMAT, version=FORMAT_VERSION, what="plan", where=where,
                     required=("world_size", "policy", "m_mem", "step_budget_s", "cost_model", "buckets"))
        try:
            cost = CostModel.from_json(d["cost_model"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        try:
            policy = policy_name(d["policy"])
        except ValueError as err:
            raise ValueError(f"{where}: field 'policy': {err}") from None
        return cls(int(d["world_size"]), policy, int(d["m_mem"]), int(d.get("m_mem_limit", d["m_mem"])),
                   None if d["step_budget_s"] is None else float(d["step_budget_s"]), cost, list(d["buckets"]),
                   list(d.get("dropped", [])), dict(d.get("predicted", {})), bool(d.get("drop_oversized", False)),
                   tuple(d.get("patch_size", (1, 2, 2))), str(d.get("source", "")), str(d.get("date", "")),
                   tuple(d.get("vae_stride", WAN_VAE_STRIDE)), str(d.get("memory_source", "")),
                   None if d.get("memory_budget_gib") is None else float(d["memory_budget_gib"]))

    @classmethod
    def load(cls, path) -> "Plan":
        """Read a plan JSON. Raises FileNotFoundError, or ValueError for invalid JSON or fields."""
        path = os.fspath(path)
        return cls.from_json(read_json(path, "plan"), where=path)

    def format_table(self) -> str:
        """The bucket table next to the equal-token table, and the predicted throughput of both."""
        budget = "none (memory only)" if self.step_budget_s is None else f"{self.step_budget_s * 1e3:.1f} ms/step"
        comp = f", M_comp = {self.m_comp:.4g}" if self.m_comp is not None else ""
        packed = self.policy == "packed"
        per = " per rank (pack)" if packed else ""
        own = f"{'sample ms':>9} {'work %':>7}" if packed else f"{'B':>4} {'step ms':>8} {'steps %':>7}"
        lines = [f"plan for world size {self.world_size}, policy {self.policy}: M_mem = {self.m_mem:,} tokens{per} "
                 f"(limit {self.m_mem_limit:,}), step budget {budget}{comp}",
                 f"{'bucket (T,H,W)':>16} {'S':>7} {'samples':>9} | {own} |"
                 f" {'eq-tok B':>8} {'step ms':>8} {'steps %':>7}"]
        for row in self.buckets:
            key = "x".join(str(v) for v in row["key"])
            if packed:
                own = f"{row['sample_time_s'] * 1e3:>9.1f} {row['share_of_work'] * 100:>7.1f}"
            else:
                own = (f"{row['batch_size']:>4} {row['step_time_s'] * 1e3:>8.1f} "
                       f"{row['share_of_steps'] * 100:>7.1f}")
            lines.append(f"{key:>16} {row['seq_len']:>7} {row['num_samples']:>9} | {own} | "
                         f"{row['equal_token_batch_size']:>8} {row['equal_token_step_time_s'] * 1e3:>8.1f} "
                         f"{row['equal_token_share_of_steps'] * 100:>7.1f}")
        for row in self.dropped:
            lines.append(f"{'x'.join(str(v) for v in row['key']):>16} {row['seq_len']:>7} {row['num_samples']:>9} | dropped (S > memory limit)")
        p = self.predicted
        if p:
            lines.append(f"predicted tokens/s: plan {p['tokens_per_s']:,.0f} (idle {p['idle']:.2f}), equal-token "
                         f"{p['equal_token_tokens_per_s']:,.0f} (idle {p['equal_token_idle']:.2f}), speedup {p['speedup']:.2f}x")
        return "\n".join(lines)


def memory_limit(calibration: Calibration, max_seq_len: int, *, memory_budget_bytes=None, m_mem=None,
                 safety: float = DEFAULT_SAFETY) -> tuple[int, str, float | None]:
    """The largest tokens per batch (per pack) memory allows, where it came from, and the device memory it assumes.

    Priority: ``m_mem`` given; else the memory model at ``memory_budget_bytes`` (or
    ``calibration.settings["device_memory_bytes"]``) with ``safety``; else the largest ``B*S`` the
    calibration ran without running out of memory.

    Returns:
        ``(tokens, source, budget_bytes)``: ``source`` one of :data:`MEMORY_SOURCES`; ``budget_bytes``
        the given or recorded device memory, for a given ``m_mem`` the memory model's peak at that
        many tokens divided by ``safety`` (``None`` without a memory model or for ``"largest_batch"``).

    Raises:
        ValueError: none of these is available, or ``m_mem < 1``.

    Example::

        >>> from adaptiveload.sched.presets import load_calibration
        >>> tokens, source, budget = memory_limit(load_calibration("anchors-wan1.3b"), 75600)
        >>> tokens, source, round(budget / 2**30, 1)
        (118040, 'device', 140.4)
    """
    if m_mem is not None:
        if m_mem < 1:
            raise ValueError(f"m_mem must be >= 1 token, got {m_mem}")
        model = calibration.memory_model
        peak = None if model is None else float(model.predict(1, m_mem) if model.m2 == 0 else model.predict(
            m_mem / max_seq_len, max_seq_len))
        return int(m_mem), "m_mem", None if peak is None else peak / safety
    if memory_budget_bytes is not None:
        source, budget = "memory_budget", float(memory_budget_bytes)
    else:
        source, budget = "device", calibration.settings.get("device_memory_bytes")
    if budget is not None:
        if calibration.memory_model is None:
            raise ValueError("the calibration has no memory model (no peak memory measured): give m_mem (--m-mem) instead")
        seq = max_seq_len if calibration.memory_model.m2 > 0 else None
        return calibration.memory_model.max_tokens(budget, safety=safety, seq_len=seq), source, float(budget)
    if calibration.largest_ok_tokens is not None:
        return int(calibration.largest_ok_tokens), "largest_batch", None
    raise ValueError("no memory limit: give a memory budget (--memory-budget-gb) or m_mem (--m-mem)")


def _describe_limit(source: str, budget_bytes: float | None, safety: float) -> str:
    if source == "m_mem":
        return "given"
    if source == "largest_batch":
        return "largest B*S measured without running out of memory"
    return f"memory model at {budget_bytes / 2**30:.1f} GiB x {safety}"


def make_plan(manifest: Manifest, calibration: Calibration, world_size: int, *, memory_budget_bytes=None,
              m_mem=None, drop_oversized: bool = False, policy: str = "dual", safety: float = DEFAULT_SAFETY) -> Plan:
    """Choose ``M_mem`` and the step budget that maximise predicted tokens/s; compare with equal-token.

    Args:
        manifest: the corpus (its buckets and their sample counts).
        calibration: cost model (and memory model) of the model being trained.
        world_size: data-parallel ranks W.
        memory_budget_bytes: device memory for training; with the memory model gives the limit on
            ``M_mem`` (see :func:`memory_limit`).
        m_mem: a fixed ``M_mem`` in tokens instead of a search up to the memory limit.
        drop_oversized: drop buckets whose single sample exceeds the memory limit instead of raising.
        policy: the batching policy, one of :data:`~adaptiveload.sched.policies.POLICIES`
            (``equal_token``: the equal-token rule, no search; ``dual``, ``cost_grouped``: the budgets
            that maximise predicted tokens/s for that policy's step order; ``packed``: the step budget
            of the packer, module docstring); an older spelling (``"random"``, ``"cost-grouped"`` ...)
            is mapped by :func:`~adaptiveload.sched.policies.policy_name`.
        safety: fraction of ``memory_budget_bytes`` to plan for.

    Returns:
        A :class:`Plan` (its ``policy`` the current name).

    Raises:
        ValueError: bad world size or policy, no memory limit, or buckets with ``S`` over the memory
            limit (each named with its shape, S and sample count) without ``drop_oversized``.

    Example::

        >>> from adaptiveload.sched.manifest import Manifest
        >>> from adaptiveload.sched.presets import load_calibration
        >>> m = Manifest.from_seq_lens([1560] * 400 + [32760] * 40)
        >>> plan = make_plan(m, load_calibration("anchors-wan1.3b"), 4, m_mem=65520, policy="equal_token")
        >>> [r["batch_size"] for r in plan.buckets], plan.step_budget_s, plan.predicted["speedup"]
        ([42, 2], None, 1.0)
        >>> packed = make_plan(m, load_calibration("anchors-wan1.3b"), 4, m_mem=65520, policy="packed")
        >>> packed.m_mem, packed.predicted["speedup"] > 1.2
        (65520, True)
    """
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"Invalid world_size {world_size!r}, world_size should be a positive integer")
    policy = policy_name(policy)
    keys, inverse, counts = group_buckets(manifest.bucket_keys)
    seq = bucket_tokens(keys, manifest.patch_size)
    limit, memory_source, budget_bytes = memory_limit(calibration, int(seq.max()), memory_budget_bytes=memory_budget_bytes,
                                                      m_mem=m_mem, safety=safety)
    source = _describe_limit(memory_source, budget_bytes, safety)
    over = seq > limit
    dropped = [{"key": keys[k].tolist(), "seq_len": int(seq[k]), "num_samples": int(counts[k])} for k in np.flatnonzero(over)]
    if over.all():
        raise ValueError(f"every bucket has S over the memory limit of {limit:,} tokens ({source}; shortest "
                         f"S = {int(seq.min()):,}): give a memory budget (--memory-budget-gb) or m_mem (--m-mem)")
    if dropped and not drop_oversized:
        names = "; ".join(f"latent {tuple(r['key'])} S={r['seq_len']:,} ({r['num_samples']} samples)" for r in dropped)
        raise ValueError(f"bucket(s) longer than the memory limit of {limit:,} tokens per batch ({source}): {names}; "
                         f"raise the memory budget (--memory-budget-gb, --m-mem), use activation checkpointing, "
                         f"or drop them (--drop-oversized)")
    kseq = seq[~over]
    cost = calibration.cost_model

    def sizes_for(mm, budget):
        b = np.zeros(len(seq), dtype=np.int64)
        b[~over] = rule_batch_sizes(cost, kseq, mm, budget)
        return b

    b_eq = sizes_for(limit, None)
    eq_pred = predicted_throughput(cost, seq, counts, b_eq, world_size, "equal_token")
    chosen_mm, chosen_budget = limit, None  # the equal-token rule
    if policy == "packed":
        chosen_budget, plan_pred = _packed_budget(manifest, inverse, over, seq, counts, cost, limit, world_size)
    elif policy != "equal_token":
        longest = int(kseq.max())
        mm_candidates = [limit] if m_mem is not None else sorted(
            {int(v) for v in np.geomspace(longest, limit, M_MEM_CANDIDATES)} | {limit})
        best = None
        for mm in mm_candidates:
            b_mem = np.maximum(1, mm // kseq)
            # budgets at which some bucket's B changes: t(b, S_k) for b = 1..B_mem,k
            breakpoints = np.unique(np.concatenate([cost.predict(np.arange(1, bm + 1), s) for bm, s in zip(b_mem, kseq)]))
            if breakpoints.size > MAX_BUDGET_CANDIDATES:
                breakpoints = np.unique(np.quantile(breakpoints, np.linspace(0, 1, MAX_BUDGET_CANDIDATES)))
            # a budget just above each breakpoint admits that batch (float rounding), plus memory only
            for budget in [*(breakpoints * (1 + 1e-9)), None]:
                b = sizes_for(mm, budget)
                tps = predicted_throughput(cost, seq, counts, b, world_size, policy)["tokens_per_s"]
                if best is None or tps > best[0] * (1 + 1e-12):
                    best = (tps, mm, budget)
        _, chosen_mm, chosen_budget = best

    def shares(b):
        bucket, _, mult = batch_mix(counts, b)
        per = np.bincount(bucket, weights=mult, minlength=len(seq))
        return per / per.sum()

    share_eq = shares(b_eq)
    rows = [{"key": keys[k].tolist(), "seq_len": int(seq[k]), "num_samples": int(counts[k]),
             "equal_token_batch_size": int(b_eq[k]), "equal_token_step_time_s": float(cost.predict(b_eq[k], seq[k])),
             "equal_token_share_of_steps": float(share_eq[k])} for k in np.flatnonzero(~over)]
    if policy == "packed":
        work = cost.per_sample(seq) * np.where(over, 0, counts)
        for row, k in zip(rows, np.flatnonzero(~over)):
            row.update(sample_time_s=float(cost.per_sample(seq[k])), share_of_work=float(work[k] / work.sum()))
    else:
        b_plan = sizes_for(chosen_mm, chosen_budget)
        plan_pred = predicted_throughput(cost, seq, counts, b_plan, world_size, policy)
        share_plan = shares(b_plan)
        for row, k in zip(rows, np.flatnonzero(~over)):
            row.update(batch_size=int(b_plan[k]), step_time_s=float(cost.predict(b_plan[k], seq[k])),
                       share_of_steps=float(share_plan[k]))
    predicted = {"tokens_per_s": plan_pred["tokens_per_s"], "step_time_s": plan_pred["step_time_s"],
                 "idle": plan_pred["idle"], "equal_token_tokens_per_s": eq_pred["tokens_per_s"],
                 "equal_token_step_time_s": eq_pred["step_time_s"], "equal_token_idle": eq_pred["idle"],
                 "speedup": plan_pred["tokens_per_s"] / eq_pred["tokens_per_s"]}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Plan(int(world_size), policy, int(chosen_mm), int(limit),
                None if chosen_budget is None else float(chosen_budget), cost, rows, dropped, predicted,
                bool(drop_oversized), tuple(manifest.patch_size), manifest.source, now, tuple(manifest.vae_stride),
                memory_source, None if budget_bytes is None else budget_bytes / 2**30)


def _packed_budget(manifest: Manifest, inverse, over, seq, counts, cost: CostModel, m_mem: int,
                   world_size: int) -> tuple[float, dict]:
    """Policy ``packed``'s step budget (module docstring) and its :func:`packed_throughput`."""
    kept = np.flatnonzero(~over[inverse])
    if kept.size > PACKED_PLAN_SAMPLES:
        kept = np.sort(np.random.default_rng(0).choice(kept, PACKED_PLAN_SAMPLES, replace=False))
    samples = manifest.bucket_keys[kept]
    weight = np.where(over, 0, counts)
    work = cost.per_sample(seq)
    longest = float(work[~over].max())  # a pack must hold the longest sample ...
    full = m_mem * float(np.sum(weight * work) / np.sum(weight * seq))  # ... and holds m_mem tokens of the mix
    intercept = float(cost.predict_packs([], [0])[0])
    budgets = intercept + np.union1d(np.geomspace(0.6 * min(longest, full), 1.2 * max(longest, full), PACKED_BUDGETS),
                                     [longest])
    scores = [packed_throughput(cost, samples, m_mem, float(b), world_size, patch_size=manifest.patch_size)
              for b in budgets]
    best = max(score["tokens_per_s"] for score in scores)
    ties = [k for k, score in enumerate(scores) if score["tokens_per_s"] >= best * (1 - PACKED_TIE)]
    chosen = min(ties, key=lambda k: scores[k]["composition_ks"])
    return float(budgets[chosen]), scores[chosen]
