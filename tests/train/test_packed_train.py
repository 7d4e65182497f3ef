"""`adaptiveload train --policy packed`: the pack collate, the packed training step against each sample
run alone, no recompile across pack compositions, warm-up packs, the step composition metric, and
the job end to end (two gloo ranks against a one-process per-sample reference; kill and resume)."""
import json
import os

import numpy as np
import pytest
import torch

from adaptiveload.models import WanConfig, WanDiT, build_model, patchify_packed
from adaptiveload.sched.cost_model import QuadraticCostModel
from adaptiveload.sched.metrics import composition
from adaptiveload.train.data import LatentDataset, collate, collate_pack, synthetic_pack
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.loop import compiled_graphs, warm_up_packs
from adaptiveload.train.results import step_composition, step_time_prediction
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep, flow_matching_loss

PACKS = [[(2, 4, 6), (1, 4, 6), (1, 4, 6)], [(3, 4, 4)], [(1, 4, 4), (2, 4, 6), (1, 6, 4), (1, 4, 4), (3, 2, 2)],
         [(2, 6, 8), (2, 6, 8)]]


def _step(backend="eager", lr=1e-4, checkpointing=False):
    torch.manual_seed(0)
    model = build_model("tiny")
    config = StepConfig(backend=backend, inner="aot_eager", learning_rate=lr, activation_checkpointing=checkpointing)
    return TrainStep(model, config, DistContext())


def _items(shapes, seed=3):
    spec = InputSpec.from_model(build_model("tiny", device="meta"))
    dataset = LatentDataset(np.array(shapes), spec, seed=seed)
    return spec, [dataset[i] for i in range(len(shapes))]


def test_collate_pack_orders_by_shape_and_patchifies_latents_and_noise():
    spec, items = _items([(2, 4, 6), (1, 4, 6), (2, 4, 6), (1, 2, 2)])
    items[3]["context"] = items[3]["context"][:3]  # a shorter text is zero-padded
    pack = collate_pack(items, spec.patch_size, spec.text_len)
    assert pack.indices.tolist() == [3, 1, 0, 2]  # by latent shape: equal shapes adjacent
    ordered = [items[i] for i in pack.indices.tolist()]
    tokens, grid, cu = patchify_packed([s["latents"] for s in ordered], spec.patch_size)
    assert torch.equal(pack.tokens, tokens) and torch.equal(pack.grid, grid)
    assert torch.equal(pack.layout.cu_seqlens, cu) and pack.layout.cu_seqlens.tolist() == [0, 1, 7, 19, 31]
    assert torch.equal(pack.noise, patchify_packed([s["noise"] for s in ordered], spec.patch_size)[0])
    assert torch.equal(pack.sigma, torch.stack([s["sigma"] for s in ordered]))
    assert pack.context.shape == (4, spec.text_len, spec.text_dim) and not pack.context[0, 3:].any()
    assert len(pack) == 4 and pack.num_tokens == 31 and pack.latent_shape == (2, 4, 6)
    with pytest.raises(ValueError, match="collate_pack: empty pack"):
        collate_pack([], spec.patch_size)


@pytest.mark.parametrize("weight", [1.0, 0.0])
@pytest.mark.parametrize("backend, checkpointing", [("eager", False), ("adaptiveload", True)])
def test_pack_step_equals_each_sample_alone(weight, backend, checkpointing):
    """Loss sum and gradients of a pack through forward_packed equal those of each sample alone
    through an eager model's forward (float32, 1e-5 relative), also with compiled, checkpointed
    blocks (the attention op's saved statistics inside the checkpoint); a padding pack (weight 0)
    runs and adds nothing."""
    shapes = PACKS[2]
    spec, items = _items(shapes)
    step = _step(backend, checkpointing=checkpointing)
    num_samples = 7  # the step's samples on every rank: each loss is divided by it
    loss = step.forward_backward(collate_pack(items, spec.patch_size, spec.text_len), num_samples, weight)
    grads = {n: p.grad.clone() for n, p in step.module.named_parameters()}
    reference = _step().module
    expected = sum(flow_matching_loss(reference, b.latents, b.context, b.noise, b.sigma).sum()
                   for b in (collate([item], spec.text_len) for item in items))
    (expected / num_samples).backward()
    assert float(loss) == pytest.approx(weight * float(expected.detach()), rel=1e-5)
    for name, p in reference.named_parameters():
        if weight:
            assert (grads[name] - p.grad).norm() <= 1e-5 * p.grad.norm() + 1e-10, name
        else:
            assert not grads[name].any(), name


def test_packs_of_any_composition_reuse_the_compiled_blocks():
    """Backend adaptiveload (aot_eager inside): the first pack compiles the blocks' one graph; packs
    of other sample counts, shapes and token totals compile nothing more."""
    torch._dynamo.reset()
    step = _step(backend="adaptiveload")
    spec = InputSpec.from_model(step.module)
    graphs = []
    for shapes in PACKS:
        before = compiled_graphs()
        step(synthetic_pack(spec, np.array(shapes)), len(shapes))
        graphs.append(compiled_graphs() - before)
    assert graphs == [1, 0, 0, 0]
    torch._dynamo.reset()


def test_warm_up_packs_are_each_octave_s_ends_and_the_padding_pack():
    from adaptiveload.sched.packing import PackingSampler

    shapes = np.array([(1, 4, 6)] * 40 + [(3, 8, 8)] * 3 + [(1, 2, 2)] * 2 + [(1, 6, 6)] * 10)
    # strongly quadratic: packs that hold a long clip hold fewer tokens, so the packs span octaves
    sampler = PackingSampler(shapes, 200, 0.05, QuadraticCostModel(0.01, 1e-4, 1e-4), num_replicas=2, rank=0)
    packing = sampler.epoch_plan(0)
    seq = shapes.prod(axis=1) // 4
    tokens = [int(seq[packing.order[s:s + n]].sum()) for s, n in zip(packing.pack_start, packing.pack_size)]
    octaves = {}  # packs by floor(log2(tokens))
    for t in tokens:
        octaves.setdefault(t.bit_length(), []).append(t)
    expected = sorted({1} | {min(o) for o in octaves.values()} | {max(o) for o in octaves.values()})
    assert len(octaves) > 1 and len(expected) > 3  # several octaves, one with two ends
    packs = warm_up_packs(packing, shapes)
    assert [int((p.prod(axis=1) // 4).sum()) for p in packs] == expected
    assert packs[0].tolist() == [[1, 2, 2]]  # the padding pack: the shortest sample alone


def test_warm_up_packs_cover_every_attention_group_by_hand():
    """Packs of 32, 28, 24 and 17 tokens (one 1-token sample, the padding one): the octave ends and the
    padding pack hold every (group size, length) but P2's two pairs, (2 x 8) and (2 x 4), which go
    into one more pack of 24 tokens (within the largest pack's 32)."""
    from adaptiveload.sched.packing import EpochPacking

    shape = {1: (1, 2, 2), 4: (1, 4, 4), 8: (1, 4, 8), 16: (1, 8, 8)}  # tokens -> latent shape (1x2x2 patches)
    tokens = [16, 16, 16, 8, 4, 8, 8, 4, 4, 1, 16]  # P0 = 0, 1; P1 = 2, 3, 4; P2 = 5..8; P3 = 9, 10
    latent = np.array([shape[t] for t in tokens])
    packing = EpochPacking(step_packs=np.arange(4)[:, None], pack_start=np.array([0, 2, 5, 9]),
                           pack_size=np.array([2, 3, 4, 2]), order=np.arange(11, dtype=np.int32),
                           seq_lens=np.array(tokens, dtype=np.int32), padding_sample=9)
    sums = lambda packs: [int((p.prod(axis=1) // 4).sum()) for p in packs]  # noqa: E731
    assert sums(warm_up_packs(packing, latent)) == [1, 17, 28, 32]
    packs = warm_up_packs(packing, latent, attention_groups=True)
    assert sums(packs) == [1, 17, 24, 28, 32]
    assert sorted((packs[2].prod(axis=1) // 4).tolist()) == [4, 4, 8, 8]


def test_warm_up_packs_with_attention_groups_hold_every_group_of_the_epoch():
    """A sampled epoch: every (group size, length) of its packs is in some warm-up pack, no warm-up
    pack is larger than the epoch's largest, and the octave ends and padding pack are still there."""
    from adaptiveload.sched.packing import PackingSampler

    shapes = np.array([(1, 4, 6)] * 40 + [(3, 8, 8)] * 3 + [(1, 2, 2)] * 2 + [(1, 6, 6)] * 10 + [(2, 4, 6)] * 6)
    sampler = PackingSampler(shapes, 200, 0.05, QuadraticCostModel(0.01, 1e-4, 1e-4), num_replicas=2, rank=0)
    packing = sampler.epoch_plan(0)
    seq = shapes.prod(axis=1) // 4

    def group_set(lengths):
        values, counts = np.unique(lengths, return_counts=True)
        return {(int(v), int(c)) for v, c in zip(values, counts)}

    epoch = [seq[packing.order[s:s + n]] for s, n in zip(packing.pack_start, packing.pack_size)]
    needed = set().union(*(group_set(p) for p in epoch))
    packs = warm_up_packs(packing, shapes, attention_groups=True)
    warm = [p.prod(axis=1) // 4 for p in packs]
    assert needed <= set().union(*(group_set(p) for p in warm))
    assert max(int(p.sum()) for p in warm) <= max(int(p.sum()) for p in epoch)
    plain = warm_up_packs(packing, shapes)
    assert {tuple(map(tuple, p.tolist())) for p in plain} <= {tuple(map(tuple, p.tolist())) for p in packs}
    assert len(packs) > len(plain)


def test_blocks_get_fresh_tensors():
    """forward_packed hands the blocks no views (Dynamo guards on a view's base: a view in the first
    block only would compile it a graph of its own)."""
    model = build_model("tiny")
    spec, items = _items(PACKS[2])
    pack = collate_pack(items, spec.patch_size, spec.text_len)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _, args: seen.append([a for a in args if isinstance(a, torch.Tensor)]))
    model.forward_packed(pack.tokens, pack.sigma * 1000, pack.context, pack.grid, pack.layout.cu_seqlens)
    assert len(seen) == len(model.blocks) and all(len(args) == 8 for args in seen)
    assert [[a._base is None for a in args] for args in seen] == [[True] * 8] * len(seen)


# CPU Inductor guards a reduction's length at 4,096 (it accumulates longer ones in blocks): these packs'
# tokens sum S and text tokens n * 512 fall on both sides of it
INDUCTOR_CONFIG = WanConfig(dim=32, num_layers=2, num_heads=2, ffn_dim=32, in_channels=4, out_channels=4, text_dim=16,
                            text_len=512, freq_dim=16)


@pytest.mark.slow
def test_inductor_compiles_the_graphs_of_an_epoch_in_warm_up():
    """Backend adaptiveload with Inductor inside: an epoch of 37 packs of 1 to 19 samples, sum S from 64
    to 4,608 tokens and 512 to 9,728 text tokens compiles at most 2 graphs of the blocks, one per
    side of 4,096 tokens in sum S (the text tokens are unbacked, the sample count a dynamic size),
    all in the job's warm-up; the epoch's steps compile none. (Before: 8 packs of such compositions
    compiled 8 graphs, one per combination of sides of sum S and n * L, and each again for the first
    block, whose input was a view.) About 60 s on 2 busy cores, mostly Inductor's compile."""
    from adaptiveload.sched.packing import PackingSampler
    from adaptiveload.train.loop import warm_up

    torch._dynamo.reset()
    torch.manual_seed(0)
    step = TrainStep(WanDiT(INDUCTOR_CONFIG), StepConfig(backend="adaptiveload", inner="inductor"), DistContext())
    spec = InputSpec.from_model(step.module)
    shapes = np.array([(1, 4, 4)] * 300 + [(2, 8, 8)] * 20 + [(4, 64, 72)] * 2 + [(4, 32, 64)] * 3 + [(4, 8, 8)] * 6)
    sampler = PackingSampler(shapes, 6000, 0.5, QuadraticCostModel(0.01, 1e-4, 3e-7), num_replicas=1, rank=0)
    packing = sampler.epoch_plan(0)
    packs = [packing.indices(s, 0) for s in range(packing.num_steps)]
    seq = shapes.prod(axis=1) // 4
    tokens, text = [int(seq[p].sum()) for p in packs], [len(p) * 512 for p in packs]
    assert min(tokens) <= 4096 < max(tokens) and min(text) <= 4096 < max(text) and len({len(p) for p in packs}) >= 4
    before = compiled_graphs()
    assert warm_up(step, spec, sampler, DistContext(), progress=False, latent_shapes=shapes) is None
    in_warm_up = compiled_graphs() - before
    for p in packs:
        step(synthetic_pack(spec, shapes[p]), len(p))
    assert 1 <= in_warm_up <= 2 and compiled_graphs() - before == in_warm_up
    torch._dynamo.reset()


@pytest.mark.parametrize("residual", [True, False])
def test_compiled_blocks_modulate_a_pack_per_segment(monkeypatch, residual):
    """Each block's modulation reaches the fused ops as the pack's per-sample rows [n, dim] and
    segment_ids -- no per-token modulation kept for backward: on CPU, where the residual patterns
    apply, norm1 as adaln_modulate_segmented and the two residual sites (norm2, norm3) as
    residual_adaln_modulate_segmented; without them (CUDA, until the residual kernels are fast enough:
    FUSED_DEVICES), norm1 and norm3 as adaln_modulate_segmented. The pack's loss and gradients still
    equal each sample's alone (float32)."""
    from adaptiveload.fxfuse import registry

    if not residual:
        monkeypatch.setattr(registry, "_patterns", {p.name: p for p in registry.patterns()
                                                    if not p.name.startswith("residual_")})
    torch._dynamo.reset()
    shapes = PACKS[2]
    spec, items = _items(shapes)
    step = _step("adaptiveload")
    pack = collate_pack(items, spec.patch_size, spec.text_len)
    step.forward_backward(pack, len(shapes), 1.0)  # compiles (the op's fake runs would show in the profile)
    step.module.zero_grad(set_to_none=True)
    with torch.profiler.profile() as prof:
        step.forward_backward(pack, len(shapes), 1.0)
    grads = {n: p.grad.clone() for n, p in step.module.named_parameters()}
    names = [e.name for e in prof.events()]
    layers = len(step.module.blocks)
    plain, folded = (layers, 2 * layers) if residual else (2 * layers, 0)
    for op, count in (("adaln_modulate", plain), ("residual_adaln_modulate", folded)):
        assert names.count(f"adaptiveload::{op}_segmented") == count, sorted(set(names))
        assert names.count(f"adaptiveload::{op}_segmented_backward") == count
        assert names.count(f"adaptiveload::{op}") == count  # only inside the segmented op
    reference = _step().module
    expected = sum(flow_matching_loss(reference, b.latents, b.context, b.noise, b.sigma).sum()
                   for b in (collate([item], spec.text_len) for item in items))
    (expected / len(shapes)).backward()
    for name, param in reference.named_parameters():
        assert (grads[name] - param.grad).norm() <= 1e-5 * param.grad.norm() + 1e-10, name
    torch._dynamo.reset()


def test_step_composition_is_the_metric_of_the_trained_indices():
    history = [{"indices": [[0, 1], [2]]}, {"indices": [[3], []]}, {"indices": [[4, 5], [6]]}]
    seq = np.array([5, 5, 9, 9, 5, 7, 9])
    ks, lag1 = composition([0, 0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5, 6], seq)
    got = step_composition(history, seq)
    assert got["composition_ks"] == pytest.approx(ks) and np.isnan(lag1) == np.isnan(got["composition_lag1_corr"])
    assert np.isnan(step_composition([], seq)["composition_ks"])


def test_step_time_prediction_is_the_slowest_ranks_pack_against_the_measured_step():
    """Hand-computed: t = 0.1 + 0.01 S + 0.001 S^2 per sample (intercept 0.1 once a pack)."""
    cost = QuadraticCostModel(0.1, 0.01, 0.001)
    seq = np.array([10, 20, 10, 30])
    # rank packs: step 0 {10, 20} vs {10}: 0.1 + (0.1 + 0.1) + (0.2 + 0.4) = 0.9 against 0.3;
    # step 1 {30} vs no sample (the intercept): 0.1 + 0.3 + 0.9 = 1.3; step 2 profiled, step 3 compiled
    history = [{"indices": [[0, 1], [2]], "step_time_s": 1.0, "busy_s": None},
               {"indices": [[3], []], "step_time_s": 1.04, "busy_s": None},
               {"indices": [[0], [1]], "step_time_s": 9.0, "busy_s": [1.0, 1.0]},
               {"indices": [[0], [1]], "step_time_s": 9.0, "busy_s": None, "compiled": True}]
    got = step_time_prediction(history, seq, cost)
    rel = np.array([0.9 / 1.0 - 1, 1.3 / 1.04 - 1])
    assert got["step_time_predicted_steps"] == 2
    assert got["step_time_rel_err_median"] == pytest.approx(np.median(np.abs(rel)))
    assert got["step_time_rel_err_mean"] == pytest.approx(rel.mean())
    empty = step_time_prediction(history[2:], seq, cost)
    assert empty["step_time_predicted_steps"] == 0 and np.isnan(empty["step_time_rel_err_median"])
    assert np.isnan(step_time_prediction(history, seq, None)["step_time_rel_err_median"])


def test_policy_packed_needs_a_forward_packed_method(monkeypatch, capsys, tmp_path):
    """A model without forward_packed: exit 2 before any calibration or step, one line naming it."""
    from adaptiveload.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the job would set this process's torch threads otherwise
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    args = ["train", "--model", "faulty_model:without_forward_packed", "--policy", "packed", "--quiet",
            "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "adaptiveload train: error: --policy packed needs a model with a forward_packed method (it runs a pack of "
        "samples of different lengths as one sequence); faulty_model:without_forward_packed (UnpackedDiT) has "
        "none: use --policy dual, cost_grouped or equal_token\n")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------- end to end

# GPU-calibrated costs on the CPU corpus (S 18..1,050): packs of several short samples, long ones alone
PACKED = ("--policy", "packed", "--calibration", "anchors-wan1.3b", "--m-mem", "2100", "--backend", "eager",
          "--eval-every", "4", "--profile-every", "0", "--quiet")


def _run(out):
    return json.loads((out / "results.json").read_text())["runs"][0]


def _reference(history, num_samples, lr):
    """One process, no packs: each step's samples (all ranks) run alone through forward, the loss
    summed and divided by the step's sample count, AdamW; returns per-step losses and final weights."""
    torch.manual_seed(0)
    model = build_model("tiny")
    spec = InputSpec.from_model(model)
    dataset = LatentDataset(_corpus(num_samples).latent_shapes, spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for h in history:
        samples = [i for rank in h["indices"] for i in rank]
        total = sum(flow_matching_loss(model, b.latents, b.context, b.noise, b.sigma).sum()
                    for b in (collate([dataset[i]], spec.text_len) for i in samples))
        loss = total / len(samples)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {f"model.{n}": p.detach() for n, p in model.named_parameters()}


def _relative(a: dict, b: dict) -> float:
    keys = sorted(b)
    assert sorted(a) == keys
    diff = torch.cat([(a[k].double() - b[k].double()).flatten() for k in keys])
    return float(diff.norm() / torch.cat([b[k].double().flatten() for k in keys]).norm())


@pytest.mark.slow
@pytest.mark.parametrize("samples, m_mem, padding", [(40, 2100, 0), (25, 1050, 1)])
def test_two_gloo_ranks_train_every_sample_once_like_one_process(tmp_path, run_cli, checkpoint_weights, samples,
                                                                  m_mem, padding):
    """Two ranks, FSDP2 over gloo, one epoch of packs: every sample trained exactly once (per the
    history), a padding pack (25 samples at M_mem 1,050: 7 packs, memory-bound) counted nowhere, and
    every step's loss and the final weights equal a one-process run of the same steps' samples each
    alone through forward (1e-5 relative; measured 6e-7 for the losses and 9e-8 for the weights,
    which moved 8e-2)."""
    out = tmp_path / "out"
    proc = run_cli("train", *PACKED, "--m-mem", m_mem, "--samples", samples, "--lr", "1e-3", "--checkpoint-every",
                   "1000", "--out", out, nproc=2, timeout=200)  # the last --m-mem counts
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = _run(out)
    history = run["history"]
    assert run["status"] == "ok" and run["policy"] == "packed" and run["steps"] == run["steps_per_epoch"] > 1
    trained = sorted(i for h in history for rank in h["indices"] for i in rank)
    assert trained == list(range(samples))
    assert sum(not rank for h in history for rank in h["indices"]) == padding
    assert padding or any(len(rank) > 1 for h in history for rank in h["indices"])  # packs of several samples
    corpus_seq = _corpus(samples).seq_lens
    for h in history:
        assert h["batch_sizes"] == [len(rank) for rank in h["indices"]]
        assert h["tokens"] == [int(corpus_seq[rank].sum()) if rank else 0 for rank in h["indices"]]
        assert h["seq_lens"][0] == max(corpus_seq[h["indices"][0]])
        assert h["global_samples"] == sum(h["batch_sizes"]) and h["global_tokens"] == sum(h["tokens"])
    assert run["samples"] == samples and run["tokens"] == int(corpus_seq.sum())
    assert run["composition_ks"] == pytest.approx(step_composition(history, corpus_seq)["composition_ks"])
    assert run["compiled_graphs_in_training"] == 0
    losses, weights = _reference(history, samples, lr=1e-3)
    np.testing.assert_allclose([h["loss"] for h in history], losses, rtol=1e-5)
    assert _relative(checkpoint_weights(out / "eager_packed"), weights) < 1e-5
    assert "step composition KS" in proc.stdout


def _corpus(num_samples):
    """The job's corpus: the reference mix of ``num_samples`` at the CPU downscale."""
    from adaptiveload.train.setup import load_corpus

    return load_corpus(None, num_samples, 0, None, torch.device("cpu"))[0]


@pytest.mark.slow
def test_killed_and_resumed_run_trains_the_same_steps(tmp_path, run_cli, checkpoint_weights):
    """The process dies inside step 5 (after the checkpoint of step 4); --resume continues: the same
    samples in the same steps, the same losses, and the final weights of an uninterrupted run."""
    args = (*PACKED, "--samples", "40", "--model", "faulty_model:dies_after_checkpoint", "--steps", "7",
            "--checkpoint-every", "1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", *args, "--out", straight).returncode == 0
    os.environ["ADAPTIVELOAD_TEST_DIE_AT"] = "step_000004"
    try:
        first = run_cli("train", *args, "--out", resumed)
    finally:
        del os.environ["ADAPTIVELOAD_TEST_DIE_AT"]
    assert first.returncode == 9, first.stderr[-3000:]
    run_dir = resumed / "eager_packed"
    assert (run_dir / "checkpoint" / "latest").read_text().strip() == "step_000004"
    second = run_cli("train", *args, "--resume", "--out", resumed)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = _run(straight), _run(resumed)
    assert [h["indices"] for h in b["history"]] == [h["indices"] for h in a["history"]]
    np.testing.assert_allclose([h["loss"] for h in b["history"]], [h["loss"] for h in a["history"]], rtol=1e-6)
    assert _relative(checkpoint_weights(run_dir), checkpoint_weights(straight / "eager_packed")) < 1e-6
    assert b["steps"] == 7
