"""DualConstraintBucketSampler and PackingSampler under real torch.distributed (gloo, CPU, spawned processes)."""
import hashlib
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adaptiveload.sched import DualConstraintBucketSampler, PackingSampler, reference_mix
from adaptiveload.sched.cost_model import QuadraticCostModel

NUM_SAMPLES = 4000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for policy in ("random", "cost_grouped"):
            _check_policy(world, rank, policy)
        _check_packed(world, rank)
    finally:
        dist.destroy_process_group()


def _check_policy(world, rank, policy):
    shapes = reference_mix(NUM_SAMPLES, seed=9).latent_shapes
    sampler = DualConstraintBucketSampler(shapes, m_mem=151200, m_comp=1.5 * 75600**1.41, p=1.41, seed=5,
                                          policy=policy, cost_model=QuadraticCostModel(0.019, 7.2e-6, 4e-10))
    assert (sampler.num_replicas, sampler.rank) == (world, rank)  # taken from torch.distributed
    sampler.set_epoch(2)
    plan = sampler.epoch_plan()
    digest = hashlib.sha1(plan.step_batches.tobytes() + plan.order.tobytes()).hexdigest()
    batches = list(sampler)
    gathered = [None] * world
    dist.all_gather_object(gathered, (digest, batches))
    digests = {d for d, _ in gathered}
    assert len(digests) == 1, "ranks built different epoch plans"
    steps = {len(b) for _, b in gathered}
    assert len(steps) == 1, f"unequal step counts per rank: {[len(b) for _, b in gathered]}"
    counts = np.zeros(NUM_SAMPLES, dtype=np.int64)
    repeated = 0
    for step in range(steps.pop()):
        per_rank = [gathered[r][1][step] for r in range(world)]
        for b in per_rank:
            np.add.at(counts, b, 1)
        flat = [i for b in per_rank for i in b]
        if len(flat) != len(set(flat)):  # only a repeated (padding) batch may overlap another
            repeated += 1
    assert counts.min() == 1, "a sample was never used"
    extra = counts.sum() - NUM_SAMPLES
    # padding repeats at most world - 1 whole batches
    assert extra <= (world - 1) * int(sampler.bucket_batch_sizes.max())
    assert repeated <= world - 1
    # a collective per step works: every rank reaches the same number of all_reduce calls
    total = torch.zeros(1)
    for batch in batches:
        t = torch.tensor([float(len(batch))])
        dist.all_reduce(t)
        total += t
    assert int(total.item()) == counts.sum()


def _check_packed(world, rank):
    shapes = reference_mix(NUM_SAMPLES, seed=9).latent_shapes
    sampler = PackingSampler(shapes, 151200, 2.85, QuadraticCostModel(0.019, 7.2e-6, 4e-10), seed=5)
    assert (sampler.num_replicas, sampler.rank) == (world, rank)
    sampler.set_epoch(2)
    plan = sampler.epoch_plan()
    digest = hashlib.sha1(plan.step_packs.tobytes() + plan.order.tobytes()).hexdigest()
    packs = list(sampler)
    weights = [sampler.loss_weight(step) for step in range(len(packs))]
    gathered = [None] * world
    dist.all_gather_object(gathered, (digest, packs, weights))
    assert len({d for d, _, _ in gathered}) == 1, "ranks built different packings"
    assert len({len(p) for _, p, _ in gathered}) == 1, "unequal step counts per rank"
    counts = np.zeros(NUM_SAMPLES, dtype=np.int64)
    for _, rank_packs, rank_weights in gathered:
        for pack, weight in zip(rank_packs, rank_weights):
            if weight:
                np.add.at(counts, pack, 1)
    assert counts.tolist() == [1] * NUM_SAMPLES
    # a collective per step: every rank reaches the same number of all_reduce calls; padding counts 0
    total = torch.zeros(1)
    for pack, weight in zip(packs, weights):
        t = torch.tensor([float(len(pack)) * weight])
        dist.all_reduce(t)
        total += t
    assert int(total.item()) == NUM_SAMPLES


@pytest.mark.slow  # spawns 3 processes: ~20 s on 2 cores
def test_all_ranks_agree_with_exact_coverage():
    # one process group of 3 ranks (a world size that divides nothing evenly) checks both step orders and packing
    mp.spawn(_worker, args=(3, _free_port()), nprocs=3, join=True)
