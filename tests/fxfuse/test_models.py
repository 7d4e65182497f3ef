"""Real diffusion transformers at tiny random-init configs (diffusers 0.42.1), compiled with the
backend: every LayerNorm→modulate and RMSNorm→modulate site their code executes is fused, and
training matches eager.

Inner compiler: aot_eager (the backend's graph goes through AOTAutograd and the op's autograd
formula; Inductor-CPU code generation is covered by the slow tests in test_backend.py, and would hit
an upstream bug on DiT's patchify: Inductor on CPU computes a wrong LayerNorm input gradient for
transposed inputs).
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import profile

from adaptiveload.fxfuse import collect_reports

diffusers = pytest.importorskip("diffusers")

NUM_LAYERS = 2


def _dit():
    # DiTTransformer2DModel (transformers/dit_transformer_2d.py), norm_type "ada_norm_zero":
    # each BasicTransformerBlock (attention.py) runs
    #   norm1 = AdaLayerNormZero: self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]  (1)
    #   no attn2 (no cross_attention_dim), so no norm2 chain
    #   self.norm3(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]              (2)
    # and the head: self.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None]       (+1)
    # => 2 * num_layers + 1 sites.
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=NUM_LAYERS, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([10, 500]),
                  class_labels=torch.tensor([1, 2]))
    # eval(): in training mode the label embedding drops class labels at random (class_dropout_prob),
    # so two runs would not see the same inputs; gradients are still computed
    return model.eval(), kwargs, 2 * NUM_LAYERS + 1


def _sd3():
    # SD3Transformer2DModel (transformers/transformer_sd3.py): JointTransformerBlock (attention.py);
    # every block but the last (context_pre_only=False) runs
    #   norm1 (AdaLayerNormZero) on the image tokens, norm1_context (AdaLayerNormZero) on the
    #   text tokens, norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None], and
    #   norm2_context(c) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]                   (4)
    # the last block (context_pre_only=True): norm1, norm1_context = AdaLayerNormContinuous
    #   (self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]), norm2; no norm2_context    (3)
    # head: norm_out = AdaLayerNormContinuous                                                  (+1)
    # => 4 * (num_layers - 1) + 3 + 1 = 4 * num_layers sites.
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=NUM_LAYERS, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        out_channels=4, pos_embed_max_size=16,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  pooled_projections=torch.randn(2, 8), timestep=torch.tensor([10, 500]))
    return model, kwargs, 4 * NUM_LAYERS


def _wan():
    # WanTransformer3DModel (transformers/transformer_wan.py): each WanTransformerBlock runs
    #   (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)      (1)
    #   self.norm2(...) (cross_attn_norm): a plain FP32LayerNorm, no modulation                       (0)
    #   (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)  (2)
    # head: (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)      (+1)
    # (norm_q/norm_k are RMSNorms feeding attention, not modulate chains; no image_dim, so no
    # WanImageEmbedding LayerNorms) => 2 * num_layers + 1 sites.
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=NUM_LAYERS, rope_max_seq_len=32,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 8, 8), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 5, 16))
    return model, kwargs, 2 * NUM_LAYERS + 1


def _flux():
    # FluxTransformer2DModel (transformers/transformer_flux.py): each FluxTransformerBlock runs
    #   norm1, norm1_context (AdaLayerNormZero: self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]),
    #   norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None], and the same on the text tokens    (4)
    # each FluxSingleTransformerBlock: norm (AdaLayerNormZeroSingle)                                  (1)
    # head: norm_out = AdaLayerNormContinuous                                                        (+1)
    # The q/k RMSNorms (norm_q, norm_k, norm_added_q, norm_added_k) feed RoPE,
    # x * cos + rotate(x) * sin (embeddings.py apply_rotary_emb): not modulations, so not seen.
    # => 4 * num_layers + num_single_layers + 1 sites.
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=NUM_LAYERS, num_single_layers=NUM_LAYERS, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )
    img_ids = torch.zeros(6, 3)
    img_ids[:, 1] = torch.arange(6)
    kwargs = dict(hidden_states=torch.randn(2, 6, 4), encoder_hidden_states=torch.randn(2, 3, 16),
                  pooled_projections=torch.randn(2, 8), timestep=torch.tensor([0.1, 0.5]),
                  img_ids=img_ids, txt_ids=torch.zeros(3, 3))
    return model, kwargs, 5 * NUM_LAYERS + 1


def _project_wan(checkpointing: bool):
    from adaptiveload.models import build_model, make_inputs

    model = build_model("tiny", activation_checkpointing=checkpointing).train()
    latents, timestep, context = make_inputs("tiny", batch_size=2, latent_shape=(2, 8, 8),
                                             generator=torch.Generator().manual_seed(0))
    kwargs = dict(latents=latents, timestep=timestep, context=context)
    return model, kwargs, model.num_modulate_sites


MODELS = {
    "diffusers-DiT": _dit,
    "diffusers-SD3-MMDiT": _sd3,
    "diffusers-Wan": _wan,
    "diffusers-Flux": _flux,
    "adaptiveload-Wan": lambda: _project_wan(False),
    "adaptiveload-Wan-checkpointed": lambda: _project_wan(True),
}


def _loss_and_grads(model, call, kwargs):
    out = call(**kwargs)
    sample = out.sample if hasattr(out, "sample") else out
    loss = sample.float().pow(2).mean()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_every_site_is_fused_and_training_matches_eager(name):
    torch.manual_seed(0)
    model, kwargs, sites = MODELS[name]()
    ref_loss, ref_grads = _loss_and_grads(model, model, kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager"}, fullgraph=True)
    with collect_reports() as reports:
        loss, grads = _loss_and_grads(model, compiled, kwargs)

    (report,) = reports
    assert report.fused == sites and report.skipped == 0, report.table()
    if name.endswith("checkpointed"):
        assert sum(c.graph.startswith("wrap_body") for c in report.chains) == sites - 1  # all but the head
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        torch.testing.assert_close(grads[param], ref, atol=1e-5, rtol=1e-4, msg=param)


@pytest.mark.slow
def test_project_wan_checkpointed_trains_through_inductor():
    """End to end with Inductor as the inner compiler: the tiny Wan with activation checkpointing
    (its patchify output is made contiguous, so the upstream bug of Inductor on CPU, a wrong
    LayerNorm input gradient for transposed inputs, does not apply)."""
    torch.manual_seed(0)
    model, kwargs, sites = _project_wan(True)
    ref_loss, ref_grads = _loss_and_grads(model, model, kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", fullgraph=True)
    with collect_reports() as reports:
        loss, grads = _loss_and_grads(model, compiled, kwargs)

    (report,) = reports
    assert report.fused == sites and report.skipped == 0, report.table()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        torch.testing.assert_close(grads[param], ref, atol=1e-5, rtol=1e-4, msg=param)


# --- RMSNorm→modulate models --------------------------------------------------------------------
# Each factory returns (model, kwargs, {op: forward calls one forward makes}); the counts come from
# reading the diffusers 0.42.1 source, as commented. Their RMSNorms are diffusers' RMSNorm class
# (normalization.py), written out by hand: x * torch.rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True)
# + eps) [* weight]. Mochi, Lumina2 and Z-Image have graph breaks (several graphs, some compiled
# twice), so the fused calls are counted in one forward with torch.profiler, not from the counters.

RMS = "adaptiveload::rms_norm_modulate"
ADALN = "adaptiveload::adaln_modulate"


def _ltx():
    # LTXVideoTransformer3DModel (transformers/transformer_ltx.py): each LTXVideoTransformerBlock runs
    #   self.norm1(hidden_states) * (1 + scale_msa) + shift_msa                                    (1)
    #   attn2 (cross attention) on hidden_states itself, no norm
    #   self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp                                    (2)
    # (norm1/norm2: RMSNorm(dim, elementwise_affine=False), weightless; attn.norm_q/norm_k are
    # torch.nn.RMSNorm feeding attention, not modulated)
    # head: self.norm_out(hidden_states) * (1 + scale) + shift, norm_out an nn.LayerNorm          (+1 LN)
    # => 2 * num_layers RMSNorm sites, 1 LayerNorm site.
    model = diffusers.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                                 attention_head_dim=8, cross_attention_dim=16,
                                                 num_layers=NUM_LAYERS, caption_channels=16)
    kwargs = dict(hidden_states=torch.randn(2, 2 * 4 * 4, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5), num_frames=2,
                  height=4, width=4)
    return model, kwargs, {RMS: 2 * NUM_LAYERS, ADALN: 1}


def _ltx2():
    # LTX2VideoTransformer3DModel (transformers/transformer_ltx2.py): each LTX2VideoTransformerBlock runs
    #   norm1 (video) and audio_norm1, each * (1 + scale_msa) + shift_msa                          (2)
    #   norm2 / audio_norm2: modulated only with cross_attn_mod (False here)                       (0)
    #   audio_to_video_norm(hidden_states) feeds two chains, * (1 + video_a2v_ca_scale) + ... and
    #   * (1 + video_v2a_ca_scale) + ...; video_to_audio_norm(audio) the same two                  (4)
    #   norm3 and audio_norm3, each * (1 + scale_mlp) + shift_mlp                                   (2)
    # head: norm_out and audio_norm_out (nn.LayerNorm) * (1 + scale) + shift                      (+2 LN)
    # => 8 * num_layers RMSNorm→modulate calls, 2 LayerNorm ones.
    model = diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=NUM_LAYERS, caption_channels=16)
    kwargs = dict(hidden_states=torch.randn(2, 2 * 4 * 4, 8), audio_hidden_states=torch.randn(2, 6, 8),
                  encoder_hidden_states=torch.randn(2, 5, 16), audio_encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10.0, 500.0]), num_frames=2, height=4, width=4, audio_num_frames=6)
    return model, kwargs, {RMS: 8 * NUM_LAYERS, ADALN: 2}


def _mochi():
    # MochiTransformer3DModel (transformers/transformer_mochi.py): each MochiTransformerBlock runs
    #   norm1 = MochiRMSNormZero: self.norm(hs.to(float32)) * (1 + scale_msa[:, None].to(float32))    (1)
    #   norm1_context: MochiRMSNormZero (1), or in the last block (context_pre_only)
    #     MochiLayerNormContinuous: MochiModulatedRMSNorm(x, 1 + scale.unsqueeze(1).to(float32))    (1)
    #   norm2 / norm4 (and their _context): MochiModulatedRMSNorm(x, tanh(gate)): a gate, no 1 + (0)
    #   norm3(hs, 1 + scale_mlp.unsqueeze(1).to(float32))                                          (1)
    #   norm3_context likewise, except in the last block                                         (1 / 0)
    # head: norm_out = AdaLayerNormContinuous (LayerNorm)                                      (+1 LN)
    # => 4 * (num_layers - 1) + 3 RMSNorm sites, 1 LayerNorm site.
    model = diffusers.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8,
                                              num_layers=NUM_LAYERS, pooled_projection_dim=16, in_channels=4,
                                              text_embed_dim=16, time_embed_dim=4, max_sequence_length=16)
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 4, 4), encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))
    return model, kwargs, {RMS: 4 * (NUM_LAYERS - 1) + 3, ADALN: 1}


def _lumina2():
    # Lumina2Transformer2DModel (transformers/transformer_lumina2.py): each Lumina2TransformerBlock with
    # modulation (noise_refiner and layers; context_refiner has none) runs
    #   norm1 = LuminaRMSNormZero: self.norm(x) * (1 + scale_msa[:, None])                      (1)
    #   self.ffn_norm1(hidden_states) * (1 + scale_mlp.unsqueeze(1))                            (2)
    #   gate_msa.unsqueeze(1).tanh() * self.norm2(attn_output): a gate, no 1 +                  (0)
    # (RMSNorm(dim, eps) has a weight: the op gets it)
    # head: norm_out = LuminaLayerNormContinuous: self.norm(x) * (1 + scale)[:, None, :]     (+1 LN)
    # => 2 * (num_refiner_layers + num_layers) RMSNorm sites, 1 LayerNorm site.
    model = diffusers.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32,
                                                num_layers=NUM_LAYERS, num_refiner_layers=1, num_attention_heads=4,
                                                num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 2, 2),
                                                axes_lens=(16, 16, 16), cap_feat_dim=16)
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([0.1, 0.5]),
                  encoder_hidden_states=torch.randn(2, 5, 16),
                  encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))
    return model, kwargs, {RMS: 2 * (1 + NUM_LAYERS), ADALN: 1}


def _z_image():
    # ZImageTransformer2DModel (transformers/transformer_z_image.py): each ZImageTransformerBlock with
    # modulation (noise_refiner and layers; context_refiner has none; no siglip) runs, with
    # scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp:
    #   self.attention_norm1(x) * scale_msa                                                      (1)
    #   self.ffn_norm1(x) * scale_mlp                                                            (2)
    #   gate * self.attention_norm2(...), gate * self.ffn_norm2(...): gates, no 1 +             (0)
    # head: FinalLayer: self.norm_final(x) * scale, scale = 1.0 + ... (LayerNorm)             (+1 LN)
    # => 2 * (n_refiner_layers + n_layers) RMSNorm sites, 1 LayerNorm site.
    model = diffusers.ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=NUM_LAYERS, n_refiner_layers=1,
                                               n_heads=4, n_kv_heads=4, cap_feat_dim=16, axes_dims=[4, 2, 2],
                                               axes_lens=[64, 32, 32])
    kwargs = dict(x=[torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)], t=torch.tensor([0.1, 0.5]),
                  cap_feats=[torch.randn(5, 16), torch.randn(5, 16)])
    return model, kwargs, {RMS: 2 * (1 + NUM_LAYERS), ADALN: 1}


RMS_MODELS = {
    "LTX-Video": _ltx,
    "LTX-2": _ltx2,
    "Mochi": _mochi,
    "Lumina2": _lumina2,
    "Z-Image": _z_image,
}


def _sum_of_squares(out) -> torch.Tensor:
    """The mean square of every output tensor summed (LTX-2 has a video and an audio sample,
    Z-Image a list of samples)."""
    outputs = out.values() if hasattr(out, "values") else [out]
    flat = [t for o in outputs for t in (o if isinstance(o, (list, tuple)) else [o])]
    return sum(t.float().pow(2).mean() for t in flat)


def _op_calls(call, kwargs) -> collections.Counter:
    """Forward calls of adaptiveload ops in one forward of ``call`` (compiled already, in the grad mode
    it was compiled in: no recompile), as torch.profiler records them."""
    with profile() as prof:
        call(**kwargs)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload::"))


# LTX-Video (3 s on a 2-core CPU) in the fast suite; the others (6-11 s each: several graphs, or
# LTX-2's two streams) are marked slow
@pytest.mark.parametrize("name", [n if n == "LTX-Video" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in RMS_MODELS])
def test_every_rms_norm_site_is_fused_and_training_matches_eager(name):
    torch.manual_seed(0)
    model, kwargs, calls = RMS_MODELS[name]()
    ref_loss = _sum_of_squares(model(**kwargs))
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager"})
    loss = _sum_of_squares(compiled(**kwargs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert _op_calls(compiled, kwargs) == calls

    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        torch.testing.assert_close(grads[param], ref, atol=1e-5, rtol=1e-4, msg=param)
