"""The reference Wan 2.1-style DiT: shapes, dtypes, parity with diffusers, checkpointing,
compilation with dynamic shapes, trainability and input errors."""
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from adaptiveload.models import PRESETS, WanConfig, WanDiT, build_model, make_inputs
from adaptiveload.models.wan import FP32LayerNorm

# One block, tiny sizes: what the compile tests use to stay fast on a 2-core CPU.
ONE_BLOCK = WanConfig(dim=32, num_layers=1, num_heads=2, ffn_dim=64, in_channels=3, out_channels=3,
                      text_dim=16, text_len=5, freq_dim=16)


def flow_matching_pair(latents, timestep, noise):
    """Rectified flow: the noisy input ``(1 - s) latents + s noise`` (s = t / 1000) and the velocity
    target ``noise - latents``."""
    sigma = (timestep / 1000.0).view(-1, 1, 1, 1, 1)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def flow_matching_loss(model, latents, timestep, context, noise):
    """Mean squared error of the predicted velocity."""
    noisy, target = flow_matching_pair(latents, timestep, noise)
    return (model(noisy, timestep, context).float() - target).pow(2).mean()


@pytest.mark.parametrize("batch,shape", [(1, (1, 2, 2)), (2, (1, 8, 6)), (2, (3, 4, 10)), (3, (2, 6, 6))])
def test_output_shape_and_dtype(batch, shape):
    torch.manual_seed(0)
    model = build_model("tiny")
    latents, timestep, context = make_inputs("tiny", batch, shape)
    out = model(latents, timestep, context)
    assert out.shape == (batch, PRESETS["tiny"].out_channels, *shape)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_samples_are_independent():
    """Sample 0's output does not depend on sample 1's inputs (no mixing across the batch)."""
    torch.manual_seed(0)
    model = build_model("tiny")
    latents, timestep, context = make_inputs("tiny", 2, (2, 4, 4))
    out = model(latents, timestep, context)
    latents2, context2 = latents.clone(), context.clone()
    latents2[1] += 1.0
    context2[1] -= 1.0
    out2 = model(latents2, timestep, context2)
    torch.testing.assert_close(out2[0], out[0])
    assert not torch.allclose(out2[1], out[1])


def test_bf16_model_and_autocast():
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs = make_inputs("tiny", 2, (2, 4, 6))
    ref = model(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out = model(*inputs)
    assert autocast_out.dtype == torch.float32
    bf16_model = build_model("tiny", dtype=torch.bfloat16)
    bf16_model.load_state_dict(model.state_dict())
    bf16_inputs = (inputs[0].bfloat16(), inputs[1], inputs[2].bfloat16())
    bf16_out = bf16_model(*bf16_inputs)
    assert bf16_out.dtype == torch.bfloat16
    for out in (autocast_out, bf16_out.float()):
        assert (out - ref).norm() / ref.norm() < 0.05


def test_num_modulate_sites_counts_the_modulated_norms_a_forward_runs():
    """Non-affine FP32 LayerNorms (norm1, norm3 of each block and norm_out) are the modulated ones."""
    model = build_model(WanConfig(dim=24, num_layers=3, num_heads=2, ffn_dim=32, in_channels=2, out_channels=2,
                                  text_dim=8, text_len=3, freq_dim=8))
    calls = []
    for module in model.modules():
        if isinstance(module, FP32LayerNorm) and not module.elementwise_affine:
            module.register_forward_hook(lambda *_: calls.append(1))
    model(*make_inputs(model.config, 1, (1, 2, 2)))
    assert model.num_modulate_sites == len(calls) == 2 * 3 + 1


def test_num_norm_sites_counts_every_layer_norm_a_forward_runs():
    """norm1, norm2 (affine, behind the cross-attention residual) and norm3 of each block, and norm_out."""
    model = build_model(WanConfig(dim=24, num_layers=3, num_heads=2, ffn_dim=32, in_channels=2, out_channels=2,
                                  text_dim=8, text_len=3, freq_dim=8))
    calls = []
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.register_forward_hook(lambda *_: calls.append(1))
    model(*make_inputs(model.config, 1, (1, 2, 2)))
    assert model.num_norm_sites == len(calls) == 3 * 3 + 1


@pytest.mark.parametrize("name,low,high", [("wan2.1-1.3b", 1.3e9, 1.5e9), ("wan2.1-14b", 14.0e9, 14.5e9)])
def test_preset_parameter_counts(name, low, high):
    """Released checkpoints: Wan2.1-T2V-1.3B has 1.42e9 parameters, Wan2.1-T2V-14B 14.29e9."""
    model = build_model(name, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert low < count < high
    assert all(p.is_meta for p in model.parameters())


def diffusers_wan(config: WanConfig, device=None):
    transformer_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    with torch.device(device or "cpu"):
        return transformer_wan.WanTransformer3DModel(
            patch_size=config.patch_size, num_attention_heads=config.num_heads, attention_head_dim=config.head_dim,
            in_channels=config.in_channels, out_channels=config.out_channels, text_dim=config.text_dim,
            freq_dim=config.freq_dim, ffn_dim=config.ffn_dim, num_layers=config.num_layers,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=config.eps,
        )


# our parameter name -> diffusers' WanTransformer3DModel parameter name
_NAME_MAP = [
    (r"^time_embedding\.0\.", "condition_embedder.time_embedder.linear_1."),
    (r"^time_embedding\.2\.", "condition_embedder.time_embedder.linear_2."),
    (r"^time_projection\.1\.", "condition_embedder.time_proj."),
    (r"^text_embedding\.0\.", "condition_embedder.text_embedder.linear_1."),
    (r"^text_embedding\.2\.", "condition_embedder.text_embedder.linear_2."),
    (r"\.self_attn\.", ".attn1."),
    (r"\.cross_attn\.", ".attn2."),
    (r"\.attn(\d)\.([qkv])\.", r".attn\1.to_\2."),
    (r"\.attn(\d)\.o\.", r".attn\1.to_out.0."),
    (r"\.ffn\.0\.", ".ffn.net.0.proj."),
    (r"\.ffn\.2\.", ".ffn.net.2."),
]


def to_diffusers_name(name):
    for pattern, replacement in _NAME_MAP:
        name = re.sub(pattern, replacement, name)
    return name


@pytest.mark.parametrize("name", ["wan2.1-1.3b", "wan2.1-14b"])
def test_parameters_match_diffusers_wan_on_meta(name):
    ours = {to_diffusers_name(n): tuple(p.shape) for n, p in build_model(name, device="meta").named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in diffusers_wan(PRESETS[name], device="meta").named_parameters()}
    assert ours == theirs


def test_forward_matches_diffusers_wan():
    """Same weights, same inputs: our model computes what diffusers' WanTransformer3DModel computes."""
    torch.manual_seed(0)
    model = build_model("tiny").double()
    reference = diffusers_wan(PRESETS["tiny"]).double()
    state = {to_diffusers_name(n): p for n, p in model.state_dict().items()}
    reference.load_state_dict(state, strict=True)
    latents, timestep, context = make_inputs("tiny", 2, (3, 6, 4), dtype=torch.float64)
    expected = reference(latents, timestep, context, return_dict=False)[0]
    torch.testing.assert_close(model(latents, timestep, context), expected, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_same_loss_and_gradients():
    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float64)
    inputs = make_inputs("tiny", 2, (2, 4, 6), dtype=torch.float64)
    noise = torch.randn_like(inputs[0])
    block_calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: block_calls.append(1))

    results = []
    for enabled in (False, True):
        model.set_activation_checkpointing(enabled)
        model.zero_grad()
        block_calls.clear()
        loss = flow_matching_loss(model, *inputs, noise)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(block_calls)))
    (loss_plain, grads_plain, calls_plain), (loss_ckpt, grads_ckpt, calls_ckpt) = results
    assert (calls_plain, calls_ckpt) == (1, 2)  # checkpointing re-ran the block in backward
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-12, atol=0)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_checkpointing_only_in_training_mode():
    model = build_model("tiny", activation_checkpointing=True).eval()
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    model(*make_inputs("tiny", 1, (1, 2, 2))).sum().backward()
    assert len(calls) == 1


# (T, H, W) per step: every size differs from the other input dims (batch 2, channels 3, text length
# 5, text_dim 16) and from each other, so duck sizing ties no latent dim to another dim.
SEQUENCE_SHAPES = [(4, 6, 10), (6, 10, 14), (7, 12, 18)]


def test_compiled_dynamic_matches_eager_without_recompiling_per_shape():
    """aot_eager, fullgraph, dynamic=True: outputs equal eager's, one compile for all sequence lengths.

    The first compile may count twice: with dynamic=True Dynamo makes the float LayerNorm/RMSNorm
    eps symbolic and restarts once to specialise them (torch's behaviour; diffusers' Wan does the same).
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(ONE_BLOCK).eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for shape in SEQUENCE_SHAPES:
        inputs = make_inputs(ONE_BLOCK, 2, shape)
        with torch.no_grad():
            out = compiled(*inputs)
            expected = model(*inputs)
        frames.append(counter.frame_count)
        assert out.shape == (2, ONE_BLOCK.out_channels, *shape)
        torch.testing.assert_close(out, expected)
    assert frames[0] == frames[-1] <= 2, frames  # no compile after the first sequence length
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_training_with_checkpointing_and_mark_dynamic_matches_eager():
    """aot_eager, fullgraph, checkpointed blocks, mark_dynamic on (T, H, W): loss and gradients equal
    eager's and the three sequence lengths share one compile."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(ONE_BLOCK, activation_checkpointing=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for shape in SEQUENCE_SHAPES:
        latents, timestep, context = make_inputs(ONE_BLOCK, 2, shape)
        noisy, target = flow_matching_pair(latents, timestep, torch.randn_like(latents))
        for dim in (2, 3, 4):
            torch._dynamo.mark_dynamic(noisy, dim)
        model.zero_grad()
        loss = (compiled(noisy, timestep, context) - target).pow(2).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        expected = (model(noisy, timestep, context) - target).pow(2).mean()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_adamw_steps_reduce_flow_matching_loss():
    torch.manual_seed(0)
    model = build_model("tiny")
    gen = torch.Generator().manual_seed(1)
    latents, timestep, context = make_inputs("tiny", 4, (2, 4, 4), generator=gen)
    noise = torch.randn(latents.shape, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = flow_matching_loss(model, latents, timestep, context, noise)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = build_model("tiny")
    inputs = make_inputs("tiny", 2, (2, 4, 4))
    flow_matching_loss(model, *inputs, torch.randn_like(inputs[0])).backward()
    zero = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert zero == []


def test_make_inputs_shapes_and_reproducibility():
    config = PRESETS["tiny"]
    a = make_inputs(config, 3, (2, 4, 6), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    b = make_inputs("tiny", 3, (2, 4, 6), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    latents, timestep, context = a
    assert latents.shape == (3, config.in_channels, 2, 4, 6) and latents.dtype == torch.float64
    assert timestep.shape == (3,) and timestep.dtype == torch.float32
    assert ((timestep >= 0) & (timestep < 1000)).all()
    assert context.shape == (3, config.text_len, config.text_dim) and context.dtype == torch.float64
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="wan2.1-1.3b.*wan2.1-14b") as err:
        build_model("wan2.2-5b")
    assert "tiny" in str(err.value) and "wan2.2-5b" in str(err.value)
    with pytest.raises(ValueError, match="tiny"):
        make_inputs("nope", 1)


@pytest.mark.parametrize("shape", [(1, 3, 4), (1, 4, 5)])
def test_odd_height_or_width_names_the_latents_shape(shape):
    model = build_model("tiny")
    latents = torch.randn(1, 4, *shape)
    with pytest.raises(ValueError, match=re.escape(f"latents (shape {[1, 4, *shape]})")):
        model(latents, torch.zeros(1), torch.randn(1, 8, 32))
    with pytest.raises(ValueError, match="latent_shape"):
        make_inputs("tiny", 1, shape)


@pytest.mark.parametrize(
    "latents,timestep,context,name",
    [
        ((1, 5, 1, 2, 2), (1,), (1, 8, 32), "latents"),
        ((1, 4, 2, 2), (1,), (1, 8, 32), "latents"),
        ((2, 4, 1, 2, 2), (1,), (2, 8, 32), "timestep"),
        ((1, 4, 1, 2, 2), (1,), (1, 8, 31), "context"),
        ((1, 4, 1, 2, 2), (1,), (2, 8, 32), "context"),
    ],
)
def test_bad_input_shapes_name_the_tensor(latents, timestep, context, name):
    model = build_model("tiny")
    with pytest.raises(ValueError, match=rf"{name} \(shape"):
        model(torch.randn(latents), torch.zeros(timestep), torch.randn(context))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dim=30, num_heads=4), "not divisible"),
        (dict(dim=36, num_heads=4), "even"),
        (dict(dim=0, num_heads=4), "positive"),
        (dict(dim=32, num_heads=4, patch_size=(1, 2)), "patch_size"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WanConfig(num_layers=1, ffn_dim=8, **kwargs)


def test_build_model_accepts_config_and_has_config():
    model = build_model(ONE_BLOCK)
    assert isinstance(model, WanDiT) and model.config is ONE_BLOCK
    assert not model.activation_checkpointing
    model.set_activation_checkpointing(True)
    assert model.activation_checkpointing
