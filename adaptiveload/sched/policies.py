"""The batching policies, by the one set of names every command, plan file and result uses.

* ``equal_token`` -- the usual video-trainer rule ``B = floor(M_mem_limit / S)``; ranks draw batches
  independently (each step waits for the slowest rank);
* ``dual`` -- the dual-constraint rule ``B = max(1, min(floor(M_mem / S), floor(M_comp / S^p)))`` with
  the plan's budgets (arXiv 2605.17923); ranks draw batches independently;
* ``cost_grouped`` -- the dual-constraint rule, and each global step takes W batches of similar
  predicted cost (see :mod:`adaptiveload.sched.sampler` for what this does to the data order);
* ``packed`` -- no buckets: each rank trains a pack of samples of different lengths, and each step's
  samples, taken in random order, are split so that every rank's predicted time is about the plan's
  step budget (:class:`~adaptiveload.sched.packing.PackingSampler`).

Older spellings (``equal-token``, ``dual-constraint``, ``cost-grouped``, ``random``) are accepted
for one release: :func:`policy_name` maps them to the current name.

A policy is not the sampler's *step order*: :class:`~adaptiveload.sched.sampler.DualConstraintBucketSampler`
takes ``policy="random"`` or ``"cost_grouped"`` (:data:`STEP_ORDERS`), how its batches are assigned
to steps; :func:`step_order` gives the one a bucket policy uses (``packed`` has none).
"""
from __future__ import annotations

POLICIES = ("equal_token", "dual", "cost_grouped", "packed")
STEP_ORDERS = ("random", "cost_grouped")
DEPRECATED_NAMES = {"equal-token": "equal_token", "dual-constraint": "dual", "cost-grouped": "cost_grouped",
                    "random": "dual"}


def policy_name(name: str) -> str:
    """The current name of a policy given by its current or an older spelling.

    Raises:
        ValueError: ``name`` is neither (the message lists the current names).

    Example::

        >>> policy_name("random"), policy_name("cost-grouped"), step_order("equal_token"), step_order("cost_grouped")
        ('dual', 'cost_grouped', 'random', 'cost_grouped')
    """
    if name in POLICIES:
        return name
    if name in DEPRECATED_NAMES:
        return DEPRECATED_NAMES[name]
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def step_order(policy: str) -> str:
    """How :class:`~adaptiveload.sched.sampler.DualConstraintBucketSampler` assigns batches to steps
    under ``policy``: ``"cost_grouped"`` or ``"random"``.

    Raises:
        ValueError: an unknown policy, or ``packed`` (it trains packs, not bucket batches:
            :class:`~adaptiveload.sched.packing.PackingSampler`).
    """
    name = policy_name(policy)
    if name == "packed":
        raise ValueError("policy 'packed' has no bucket step order: its sampler is PackingSampler "
                         "(adaptiveload.sched.sampler_from_plan picks the sampler of a plan)")
    return "cost_grouped" if name == "cost_grouped" else "random"
