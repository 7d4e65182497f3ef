"""TrainStep: the flow-matching loss, global-sample normalisation (one process and FSDP2 over gloo),
frozen-weight steps, one compiled graph for every bucket, and model loading errors."""
import collections
import contextlib
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.profiler import profile

from adaptiveload.train.data import Batch, LatentDataset, collate, synthetic_batch
from adaptiveload.train.distributed import DistContext
from adaptiveload.train.step import (InputSpec, NonFiniteStep, StepConfig, TrainStep, flow_matching_loss,
                                     load_model)


def _tiny_step(backend="eager", lr=1e-3, seed=0):
    torch.manual_seed(seed)
    model = load_model(preset="tiny")
    return TrainStep(model, StepConfig(backend=backend, inner="aot_eager", learning_rate=lr), DistContext()), InputSpec.from_model(model)


def test_flow_matching_loss_matches_hand_computation():
    """x_sigma = (1-s) x0 + s eps, timestep 1000 s, target eps - x0, per-sample mean square (float64)."""
    gen = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(3, 2, 1, 2, 2, generator=gen, dtype=torch.float64), torch.randn(3, 2, 1, 2, 2, generator=gen, dtype=torch.float64)
    context = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    sigma = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    seen = {}

    def model(x, t, c):  # prediction = 2 x + t / 1000 (broadcast), records what it was given
        seen.update(x=x, t=t, c=c)
        return 2 * x + (t / 1000).view(-1, 1, 1, 1, 1)

    loss = flow_matching_loss(model, x0, context, eps, sigma)
    for i, s in enumerate([0.1, 0.5, 0.9]):
        x_s = (1 - s) * x0[i] + s * eps[i]
        expected = ((2 * x_s + s - (eps[i] - x0[i])) ** 2).mean()
        assert loss[i].item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(seen["t"], torch.tensor([100.0, 500.0, 900.0], dtype=torch.float32))
    assert seen["c"] is context


def _grads(step):
    return {n: p.grad.detach().clone() for n, p in step.module.named_parameters() if p.grad is not None}


def test_unequal_batches_weight_every_sample_equally():
    """Two forward_backward calls with the global count give the gradient of the mean over all samples."""
    step, spec = _tiny_step()
    batch = synthetic_batch(spec, 4, (2, 4, 4), seed=3)
    parts = [Batch(*(t[sl] for t in (batch.indices, batch.latents, batch.context, batch.noise, batch.sigma)))
             for sl in (slice(0, 3), slice(3, 4))]
    step.forward_backward(batch, 4)
    whole = _grads(step)
    step.optimizer.zero_grad(set_to_none=True)
    for part in parts:
        step.forward_backward(part, 4)
    split = _grads(step)
    assert whole.keys() == split.keys() and len(whole) > 0
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="global_num_samples 2 < this rank's batch size 4"):
        step.forward_backward(batch, 2)


def test_frozen_weights_run_steps_without_changing_the_model():
    step, spec = _tiny_step(lr=1e-2)
    before = {n: p.detach().clone() for n, p in step.module.named_parameters()}
    with step.frozen_weights():
        step(synthetic_batch(spec, 2, (1, 4, 4)), 2)
    for name, p in step.module.named_parameters():
        assert torch.equal(p, before[name]), name
    assert not step.optimizer.state and step.optimizer.param_groups[0]["lr"] == 1e-2
    step(synthetic_batch(spec, 2, (1, 4, 4)), 2)  # a real step moves the weights
    assert any(not torch.equal(p, before[n]) for n, p in step.module.named_parameters())


@pytest.mark.parametrize("frozen", [False, True])
def test_a_non_finite_gradient_skips_the_update_and_names_the_parameter(frozen):
    """A NaN gradient (finite loss) is refused before AdamW, which would write NaN into the weights
    even at learning rate 0 (warm-up's frozen steps); the next clean step trains normally."""
    step, spec = _tiny_step(lr=1e-2)
    before = {n: p.detach().clone() for n, p in step.module.named_parameters()}
    name, param = next((n, p) for n, p in step.module.named_parameters() if n.endswith("weight"))
    hook = param.register_hook(lambda g: torch.full_like(g, float("nan")))
    batch = synthetic_batch(spec, 2, (1, 4, 4))
    context = step.frozen_weights() if frozen else contextlib.nullcontext()
    with context, pytest.raises(NonFiniteStep, match=rf"loss \d[\d.]*; non-finite gradients in 1 parameter\(s\): {name};"):
        step(batch, 2)
    assert all(p.grad is None for p in step.module.parameters())
    for n, p in step.module.named_parameters():
        assert torch.equal(p, before[n]), n
    hook.remove()
    step(batch, 2)
    assert all(torch.isfinite(p).all() for p in step.module.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in step.module.named_parameters())


def test_a_gradient_norm_overflow_skips_the_update_and_says_so():
    """Finite but huge gradients (1e20: their squares overflow float32) make the norm infinite; the
    step is refused, and the message says no gradient holds inf/NaN."""
    step, spec = _tiny_step(lr=1e-2)
    before = {n: p.detach().clone() for n, p in step.module.named_parameters()}
    param = next(p for n, p in step.module.named_parameters() if n.endswith("weight"))
    hook = param.register_hook(lambda g: torch.full_like(g, 1e20))
    with pytest.raises(NonFiniteStep, match=r"loss \d[\d.]*; every gradient is finite, but their norm overflows"):
        step(synthetic_batch(spec, 2, (1, 4, 4)), 2)
    hook.remove()
    for n, p in step.module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_non_finite_loss_skips_the_update():
    step, spec = _tiny_step()
    batch = synthetic_batch(spec, 2, (1, 4, 4))
    batch.latents[1, 0, 0, 0, 0] = float("inf")
    before = {n: p.detach().clone() for n, p in step.module.named_parameters()}
    with pytest.raises(NonFiniteStep, match=r"loss (nan|inf)"):
        step(batch, 2)
    for n, p in step.module.named_parameters():
        assert torch.equal(p, before[n]), n


def test_checkpointed_blocks_compile_inside_the_checkpoint_and_match_eager():
    """StepConfig.activation_checkpointing with regional compilation: each block's checkpoint is
    taken inside its compiled region (each new graph is compiled with the checkpoint in it; the
    rewrite's fake values once ran autograd there), the model's own switch stays off, and gradients
    match the un-checkpointed eager model's on every shape."""
    torch._dynamo.reset()
    steps = {}
    for name, backend, checkpointed in (("reference", "eager", False), ("eager", "eager", True),
                                        ("adaptiveload", "adaptiveload", True)):
        torch.manual_seed(0)
        model = load_model(preset="tiny")
        config = StepConfig(backend=backend, inner="aot_eager", learning_rate=1e-3, activation_checkpointing=checkpointed)
        steps[name] = TrainStep(model, config, DistContext())
        assert not model.activation_checkpointing
    spec = InputSpec.from_model(steps["eager"].module)
    for b, shape in [(1, (1, 6, 12)), (2, (1, 6, 12)), (2, (3, 10, 20)), (1, (2, 4, 6))]:
        batch = synthetic_batch(spec, b, shape, seed=b)
        losses = {k: float(s.forward_backward(batch, b)) for k, s in steps.items()}
        ref = _grads(steps["reference"])
        for name in ("eager", "adaptiveload"):
            assert losses[name] == pytest.approx(losses["reference"], rel=1e-5), (name, b, shape)
            got = _grads(steps[name])
            assert ref.keys() == got.keys() and ref
            for param in ref:
                torch.testing.assert_close(got[param], ref[param], rtol=1e-4, atol=1e-6,
                                           msg=f"{name}: {param} at B={b} {shape}")
        for s in steps.values():
            s.optimizer.zero_grad(set_to_none=True)


def test_residual_sites_fold_inside_checkpointed_blocks_and_match_eager():
    """Regional compile with activation checkpointing on CPU, where the residual ops fuse: in each
    of the L blocks norm1 is fused by adaln_modulate, and norm2 and norm3 together with the residual
    update in front of each by residual_adaln_modulate (the FFN residual feeds the next block's norm1
    across the region boundary; the head runs eagerly), the self-attention's q and k RMSNorm -> RoPE by
    rms_norm_rope. A step runs each forward op twice (the
    forward, and the backward's recomputation of the checkpointed block) and each backward op once,
    and its loss and every gradient match the un-checkpointed eager step's."""
    torch._dynamo.reset()
    steps = {}
    for name, backend, checkpointed in (("reference", "eager", False), ("adaptiveload", "adaptiveload", True)):
        torch.manual_seed(0)
        model = load_model(preset="tiny")
        config = StepConfig(backend=backend, inner="aot_eager", learning_rate=1e-3,
                            activation_checkpointing=checkpointed)
        steps[name] = TrainStep(model, config, DistContext())
    L = steps["adaptiveload"].module.config.num_layers
    batch = synthetic_batch(InputSpec.from_model(steps["reference"].module), 2, (1, 6, 12), seed=2)
    steps["adaptiveload"].forward_backward(batch, 2)  # compiles
    for s in steps.values():
        s.optimizer.zero_grad(set_to_none=True)
    losses = {"reference": float(steps["reference"].forward_backward(batch, 2))}
    with profile() as prof:
        losses["adaptiveload"] = float(steps["adaptiveload"].forward_backward(batch, 2))
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload::"))
    assert calls == {"adaptiveload::adaln_modulate": 2 * L, "adaptiveload::adaln_modulate_backward": L,
                     "adaptiveload::residual_adaln_modulate": 2 * 2 * L,
                     "adaptiveload::residual_adaln_modulate_backward": 2 * L,
                     "adaptiveload::rms_norm_rope": 2 * 2 * L, "adaptiveload::rms_norm_rope_backward": 2 * L}
    assert losses["adaptiveload"] == pytest.approx(losses["reference"], rel=1e-5)
    ref, got = _grads(steps["reference"]), _grads(steps["adaptiveload"])
    assert ref.keys() == got.keys() and ref
    for param in ref:
        torch.testing.assert_close(got[param], ref[param], rtol=1e-4, atol=1e-6, msg=param)


def test_activation_checkpointing_saves_no_tensor_inside_the_blocks():
    """Eager step: without checkpointing, autograd saves k_i tensors inside block i (counted between
    its forward hooks); with it, block i saves only its 5 tensor inputs (x, context, temb6, cos, sin),
    which the checkpoint keeps for the recomputation."""
    saved = {}
    per_block = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = load_model(preset="tiny")
        step = TrainStep(model, StepConfig(backend="eager", activation_checkpointing=checkpointed), DistContext())
        packed = []
        if not checkpointed:
            for block in model.blocks:
                block.register_forward_pre_hook(lambda m, a: per_block.append(-len(packed)))
                block.register_forward_hook(lambda m, a, out: per_block.append(len(packed)))
        batch = synthetic_batch(InputSpec.from_model(model), 2, (2, 4, 6))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
            step.forward_backward(batch, 2)
        saved[checkpointed] = len(packed)
    inside = sum(per_block)
    assert inside > 0 and len(per_block) == 2 * len(model.blocks)
    assert saved[True] == saved[False] - inside + 5 * len(model.blocks)


def test_activation_checkpointing_of_a_model_it_cannot_checkpoint_is_refused():
    """No list of blocks and no set_activation_checkpointing(): checkpointing on is a ValueError
    naming the model."""
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="model Sequential has no list of blocks and no set_activation_checkpointing"):
        TrainStep(model, StepConfig(backend="eager", activation_checkpointing=True), DistContext())


def test_new_bucket_shapes_reuse_the_graphs_of_their_size_class():
    """Regional compilation: every block shares one graph per batch-size class (B = 1 or not; the
    blocks see [B, S, dim], so single-frame buckets add none); new sizes, including H != W after
    H == W, do not recompile (aot_eager: the compile path, no codegen)."""
    torch._dynamo.reset()
    step, spec = _tiny_step(backend="aot_eager")
    from torch._dynamo.utils import counters

    def graphs_after(b, shape):
        step(synthetic_batch(spec, b, shape), b)
        return counters["stats"]["unique_graphs"] - before

    before = counters["stats"]["unique_graphs"]
    assert graphs_after(3, (2, 4, 4)) == 1
    assert graphs_after(2, (3, 6, 10)) == 1
    assert graphs_after(4, (1, 4, 4)) == 1
    assert graphs_after(1, (5, 8, 8)) == 2
    assert graphs_after(1, (2, 4, 6)) == 2
    assert graphs_after(1, (1, 6, 4)) == 2
    assert graphs_after(5, (4, 4, 6)) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"preset": "nope"}, "unknown model preset 'nope'"),
    ({"factory": "no_colon"}, "--model no_colon: expected MODULE:FACTORY"),
    ({"factory": "adaptiveload.missing_module:f"}, "--model adaptiveload.missing_module:f: cannot import module"),
    ({"factory": "missing_file.py:f"}, "--model missing_file.py:f: no such file: missing_file.py"),
    ({"factory": "collections:OrderedDict"}, "returned OrderedDict, not an nn.Module"),
    ({}, "exactly one of"),
])
def test_load_model_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_model(**kwargs)


_FACTORY_FILE = textwrap.dedent("""
    from adaptiveload.models import WanDiT
    from adaptiveload.models.config import PRESETS

    def build():
        return WanDiT(PRESETS["tiny"])
""")


def test_model_from_a_file_or_a_module_in_the_current_directory(tmp_path, monkeypatch):
    """--model FILE.py:FACTORY and MODULE:FACTORY with the module in the current directory, as
    `adaptiveload inspect` takes them."""
    (tmp_path / "my_dit.py").write_text(_FACTORY_FILE)
    from_file = load_model(factory=f"{tmp_path / 'my_dit.py'}:build")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_dit", raising=False)
    from_module = load_model(factory="my_dit:build")
    for model in (from_file, from_module):
        assert type(model).__name__ == "WanDiT" and model.config.dim == 64
        assert InputSpec.from_model(model) == InputSpec(in_channels=4, text_len=8, text_dim=32, patch_size=(1, 2, 2))


def test_a_preset_takes_another_patch_size():
    model = load_model(preset="tiny", patch_size=(2, 2, 2))
    assert model.patch_embedding.kernel_size == (2, 2, 2) and InputSpec.from_model(model).patch_size == (2, 2, 2)
    out = model(torch.zeros(1, 4, 4, 4, 6), torch.zeros(1), torch.zeros(1, 8, 32))
    assert out.shape == (1, 4, 4, 4, 6)


def test_an_int_patch_size_says_what_to_wrap():
    """diffusers' Flux / HunyuanVideo / CogVideoX keep an int patch_size (and CogVideoX 1.5 a
    patch_size_t): one line saying what to wrap, not a TypeError."""
    class Image(nn.Module):
        config = {"in_channels": 16, "text_dim": 4096, "patch_size": 2, "patch_size_t": 2}

    with pytest.raises(ValueError) as info:
        InputSpec.from_model(Image())
    text = str(info.value)
    assert "\n" not in text and "model Image: config.patch_size is the int 2" in text
    assert "e.g. (2, 2, 2)" in text and "adaptiveload.train.diffusers_wan" in text
    Image.config = {"in_channels": 16, "text_dim": 4096, "patch_size": (1, 2)}
    with pytest.raises(ValueError, match=r"model Image: config.patch_size must be three positive ints \(pt, ph, pw\), got \(1, 2\)"):
        InputSpec.from_model(Image())


def test_diffusers_cogvideox_gets_the_wrap_message():
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                  out_channels=4, num_layers=1, text_embed_dim=16, time_embed_dim=8,
                                                  sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
                                                  patch_size_t=2)
    with pytest.raises(ValueError, match=r"config.patch_size is the int 2 .* e.g. \(2, 2, 2\)"):
        InputSpec.from_model(model)


def test_step_config_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tvm'"):
        StepConfig(backend="tvm")


_GRAD_SCRIPT = textwrap.dedent("""
    import sys, torch
    from adaptiveload.fxfuse import collect_reports
    from adaptiveload.train.distributed import init_distributed
    from adaptiveload.train.data import LatentDataset, collate
    from adaptiveload.train.step import InputSpec, StepConfig, TrainStep, load_model
    ctx = init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = load_model(preset="tiny")
    spec = InputSpec.from_model(model)
    step = TrainStep(model, StepConfig(backend=sys.argv[2], inner="aot_eager"), ctx)
    assert step.sharded
    dataset = LatentDataset([[2, 4, 4]] * 3 + [[5, 6, 8]], spec, seed=11)
    mine = [0, 1, 2] if ctx.rank == 0 else [3]          # unequal batches: 3 samples vs 1
    with collect_reports() as reports:                  # the compiled blocks' graphs (each holds every site)
        step.forward_backward(collate([dataset[i] for i in mine]), 4)
    grads = {n: p.grad.full_tensor() for n, p in step.module.named_parameters()}
    fused = {name: max(r.of_pattern(name).fused for r in reports) for r in reports for name in r.patterns()}
    if ctx.rank == 0:
        torch.save({"grads": grads, "fused": fused}, sys.argv[1])
    ctx.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "adaptiveload"])
def test_fsdp2_gradients_match_one_process(tmp_path, run_script, backend):
    """2 ranks (gloo, FSDP2) with 3 and 1 samples give the gradient one process computes on all 4;
    with the fused backend each block's graph holds norm1 (adaln_modulate), norm2, norm3 with
    their residuals (residual_adaln_modulate) and the q/k RMSNorm -> RoPE (rms_norm_rope)."""
    script = tmp_path / "grads.py"
    script.write_text(_GRAD_SCRIPT)
    out = tmp_path / "grads.pt"
    proc = run_script(script, out, backend, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out)
    distributed = saved["grads"]
    assert saved["fused"] == ({"adaln_modulate": 1, "residual_adaln_modulate": 2, "rms_norm_rope": 2}
                              if backend == "adaptiveload" else {})
    step, spec = _tiny_step()
    dataset = LatentDataset([[2, 4, 4]] * 3 + [[5, 6, 8]], spec, seed=11)
    step.forward_backward(collate([dataset[i] for i in range(3)]), 4)
    step.forward_backward(collate([dataset[3]]), 4)
    single = _grads(step)
    assert distributed.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(distributed[name], single[name], rtol=1e-4, atol=1e-6, msg=name)
