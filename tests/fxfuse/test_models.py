"""Real diffusion transformers at tiny random-init configs (diffusers 0.42.1), compiled with the
backend: every norm site their code executes is fused -- LayerNorm→modulate and RMSNorm→modulate
sites by ``adaln_modulate`` / ``rms_norm_modulate``, and those that read a residual sum
``x + gate * y`` (or ``x + y``) together with it by ``residual_adaln_modulate`` /
``residual_rms_norm_modulate`` (plain norms behind a residual too), Wan's q/k RMSNorm → RoPE by
``rms_norm_rope`` -- and training matches eager.
Each model states its count formula per op, for a whole-model compile and, for the LayerNorm
models, for the train job's per-block (regional) compile, where a residual that feeds the next
block's norm crosses a region boundary and its norm is fused by the plain op.

Inner compiler: aot_eager (the backend's graph goes through AOTAutograd and the ops' autograd
formulas; Inductor-CPU code generation is covered by the slow tests in test_backend.py, and would hit
an upstream bug on DiT's patchify: Inductor on CPU computes a wrong LayerNorm input gradient for
transposed inputs).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import pytest
import torch
from torch.profiler import profile

from adaptiveload.fxfuse import collect_reports

diffusers = pytest.importorskip("diffusers")

NUM_LAYERS = 2
ADALN = "adaptiveload::adaln_modulate"
RES_ADALN = "adaptiveload::residual_adaln_modulate"
RMS = "adaptiveload::rms_norm_modulate"
RES_RMS = "adaptiveload::residual_rms_norm_modulate"
ROPE = "adaptiveload::rms_norm_rope"


@dataclass
class Sites:
    """Forward calls of each fused op one forward makes (from reading the diffusers 0.42.1 source):
    ``whole`` with the model compiled whole, ``per_block`` with each block of the ``blocks`` lists
    (attribute paths) compiled on its own and the rest eager, as the train job compiles."""

    whole: dict
    per_block: dict
    blocks: tuple = ("transformer_blocks",)


def _dit():
    # DiTTransformer2DModel (transformers/dit_transformer_2d.py), norm_type "ada_norm_zero":
    # each BasicTransformerBlock (attention.py) runs
    #   norm1 = AdaLayerNormZero: self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]: it reads
    #     the patch embedding in block 0 (plain), the previous block's FFN residual after that   (1)
    #   hidden_states = gate_msa.unsqueeze(1) * attn_output + hidden_states, then
    #   self.norm3(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]: residual         (2)
    #   no attn2 (no cross_attention_dim), so no norm2
    #   hidden_states = gate_mlp.unsqueeze(1) * ff_output + hidden_states
    # head: self.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None], on the last block's
    #   FFN residual                                                                               (+1)
    # whole: 1 plain (block 0's norm1), L (norm3) + L - 1 (norm1) + 1 (head) = 2L residual;
    # per block: L plain (norm1), L residual (norm3); the head is eager.
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=NUM_LAYERS, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([10, 500]),
                  class_labels=torch.tensor([1, 2]))
    L = NUM_LAYERS
    # eval(): in training mode the label embedding drops class labels at random (class_dropout_prob),
    # so two runs would not see the same inputs; gradients are still computed
    return model.eval(), kwargs, Sites({ADALN: 1, RES_ADALN: 2 * L}, {ADALN: L, RES_ADALN: L})


def _sd3():
    # SD3Transformer2DModel (transformers/transformer_sd3.py): JointTransformerBlock (attention.py).
    # Every block but the last (context_pre_only=False) runs
    #   norm1 (AdaLayerNormZero) on the image tokens, norm1_context (AdaLayerNormZero) on the text
    #     tokens: they read the previous block's FFN residuals (block 0: the embeddings, plain)     (2)
    #   hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output, then
    #     norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]: residual                        (1)
    #   the same on the text tokens: norm2_context, residual                                        (1)
    #   hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output (and the text tokens')
    # the last block (context_pre_only=True): norm1, norm1_context = AdaLayerNormContinuous
    #   (self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]), norm2 (residual); no norm2_context
    # head: norm_out = AdaLayerNormContinuous on the last block's FFN residual                       (+1)
    # whole: 2 plain (block 0's norm1, norm1_context); residual: norm2 (L) + norm2_context (L - 1)
    #   + norm1, norm1_context of blocks 1.. (2L - 2) + head (1) = 4L - 2;
    # per block: 2L plain (norm1, norm1_context), 2L - 1 residual (norm2, norm2_context); head eager.
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=NUM_LAYERS, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        out_channels=4, pos_embed_max_size=16,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  pooled_projections=torch.randn(2, 8), timestep=torch.tensor([10, 500]))
    L = NUM_LAYERS
    return model, kwargs, Sites({ADALN: 2, RES_ADALN: 4 * L - 2}, {ADALN: 2 * L, RES_ADALN: 2 * L - 1})


def _wan():
    # WanTransformer3DModel (transformers/transformer_wan.py): each WanTransformerBlock runs
    #   (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states): it reads
    #     the block's input (block 0: the patch embedding, plain; after: the previous FFN residual)  (1)
    #   hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states), then
    #     self.norm2(hidden_states.float()).type_as(hidden_states): cross_attn_norm, a plain affine
    #     FP32LayerNorm behind a residual                                                            (2)
    #   hidden_states = hidden_states + attn_output, then
    #     (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(...)        (3)
    #   hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)
    # head: (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)      (+1)
    # attn1 (WanAttnProcessor): attn.norm_q(query), attn.norm_k(key) (RMSNorm across heads), then
    #   .unflatten(2, (heads, -1)) and apply_rotary_emb: two RMSNorm -> RoPE sites                     (2)
    #   attn2 (cross-attention) has norm_q / norm_k too but no rotary_emb: plain RMSNorms feeding the
    #   attention, left alone (no image_dim, so no WanImageEmbedding LayerNorms)
    # whole: 1 plain (block 0's norm1); 3L residual (norm2, norm3 of each block, norm1 of blocks 1..,
    #   the head): the three residuals of every block; 2L RMSNorm -> RoPE;
    # per block: L plain (norm1), 2L residual (norm2, norm3); the FFN residual feeds the next block's
    #   norm1 across the region boundary, and the head is eager; 2L RMSNorm -> RoPE.
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=NUM_LAYERS, rope_max_seq_len=32,
    )
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 8, 8), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 5, 16))
    L = NUM_LAYERS
    return model, kwargs, Sites({ADALN: 1, RES_ADALN: 3 * L, ROPE: 2 * L}, {ADALN: L, RES_ADALN: 2 * L, ROPE: 2 * L},
                                ("blocks",))


def _flux():
    # FluxTransformer2DModel (transformers/transformer_flux.py): each FluxTransformerBlock runs
    #   norm1, norm1_context (AdaLayerNormZero: self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]):
    #     they read the previous double block's FFN residuals (block 0: the embeddings, plain)      (2)
    #   hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output, then
    #     norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]: residual; the same on the text
    #     tokens (norm2_context)                                                                     (2)
    #   hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output (and the text tokens')
    # each FluxSingleTransformerBlock: norm (AdaLayerNormZeroSingle) on torch.cat([text, image]):
    #   not a residual sum (the last double block's residuals feed that cat), plain                 (1)
    # head: norm_out = AdaLayerNormContinuous on a slice of the last single block's output, plain (+1)
    # The q/k RMSNorms (norm_q, norm_k, norm_added_q, norm_added_k) feed RoPE,
    # x * cos + rotate(x) * sin (embeddings.py apply_rotary_emb): not modulations, so not seen.
    # whole: plain 2 (block 0's norm1, norm1_context) + S + 1; residual 2L (norm2, norm2_context)
    #   + 2L - 2 (norm1, norm1_context of blocks 1..) = 4L - 2;
    # per block: plain 2L + S, residual 2L; the head is eager.
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=NUM_LAYERS, num_single_layers=NUM_LAYERS, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )
    img_ids = torch.zeros(6, 3)
    img_ids[:, 1] = torch.arange(6)
    kwargs = dict(hidden_states=torch.randn(2, 6, 4), encoder_hidden_states=torch.randn(2, 3, 16),
                  pooled_projections=torch.randn(2, 8), timestep=torch.tensor([0.1, 0.5]),
                  img_ids=img_ids, txt_ids=torch.zeros(3, 3))
    L = S = NUM_LAYERS
    return model, kwargs, Sites({ADALN: 2 + S + 1, RES_ADALN: 4 * L - 2}, {ADALN: 2 * L + S, RES_ADALN: 2 * L},
                                ("transformer_blocks", "single_transformer_blocks"))


def _hunyuan_video():
    # HunyuanVideoTransformer3DModel (transformers/transformer_hunyuan_video.py). The text goes through
    # the token refiner's HunyuanVideoIndividualTokenRefinerBlocks, each running
    #   self.norm1(hidden_states): a plain affine nn.LayerNorm; the previous refiner block's FFN
    #     residual in blocks 1.. (residual), proj_in's output in block 0 (no modulation: not a site)
    #   hidden_states = hidden_states + attn_output * gate_msa, then self.norm2(hidden_states): a plain
    #     affine nn.LayerNorm behind a residual                                                   (1)
    #   hidden_states = hidden_states + ff_output * gate_mlp
    # and the last refiner block's FFN residual is norm1_context's input in the first double block.
    # Each HunyuanVideoTransformerBlock (double) runs
    #   norm1, norm1_context (AdaLayerNormZero): residual but block 0's norm1 (the patch embedding)  (2)
    #   hidden_states = hidden_states + attn_output * gate_msa.unsqueeze(1) (and the text tokens'), then
    #     norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None], norm2_context alike: residual     (2)
    #   hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output (and the text tokens')
    # each HunyuanVideoSingleTransformerBlock: norm (AdaLayerNormZeroSingle) on torch.cat([image, text]):
    #   plain                                                                                        (1)
    # head: norm_out = AdaLayerNormContinuous on a slice of the last single block's output: plain  (+1)
    # whole (R refiner, L double, S single blocks): plain 1 + S + 1; residual R (refiner norm2)
    #   + R - 1 (refiner norm1 of blocks 1..) + 1 (block 0's norm1_context) + 2L (norm2, norm2_context)
    #   + 2L - 2 (norm1, norm1_context of blocks 1..) = 2R + 4L - 2;
    # per block (the three block lists): plain 2L + S; residual R (refiner norm2) + 2L.
    R, L, S = 2, NUM_LAYERS, NUM_LAYERS
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=L,
        num_single_layers=S, num_refiner_layers=R, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=False, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 4, 4), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 5, 16), encoder_attention_mask=torch.ones(2, 5),
                  pooled_projections=torch.randn(2, 8))
    return model, kwargs, Sites({ADALN: S + 2, RES_ADALN: 2 * R + 4 * L - 2}, {ADALN: 2 * L + S, RES_ADALN: R + 2 * L},
                                ("context_embedder.token_refiner.refiner_blocks", "transformer_blocks",
                                 "single_transformer_blocks"))


def _project_wan(checkpointing: bool):
    # adaptiveload/models/wan.py writes Wan's block (see _wan): whole-model compile, 1 plain and 3L
    # residual. With activation checkpointing each block is a checkpointed region (a subgraph of its
    # own): norm1 reads the region's input, and the head the last region's output: L + 1 plain,
    # 2L residual (norm2, norm3), all but the head inside the regions. Either way the self-attention's
    # q and k RMSNorm -> RoPE (apply_rope's stacked form): 2L rms_norm_rope.
    from adaptiveload.models import build_model, make_inputs

    model = build_model("tiny", activation_checkpointing=checkpointing).train()
    latents, timestep, context = make_inputs("tiny", batch_size=2, latent_shape=(2, 8, 8),
                                             generator=torch.Generator().manual_seed(0))
    kwargs = dict(latents=latents, timestep=timestep, context=context)
    L = model.config.num_layers
    whole = {ADALN: L + 1, RES_ADALN: 2 * L} if checkpointing else {ADALN: 1, RES_ADALN: 3 * L}
    return model, kwargs, Sites({**whole, ROPE: 2 * L}, {ADALN: L, RES_ADALN: 2 * L, ROPE: 2 * L}, ("blocks",))


MODELS = {
    "diffusers-DiT": _dit,
    "diffusers-SD3-MMDiT": _sd3,
    "diffusers-Wan": _wan,
    "diffusers-Flux": _flux,
    "diffusers-HunyuanVideo": _hunyuan_video,
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


def _assert_matches_eager(loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():  # absolute tolerance: attention key biases' true gradient is ~0
        torch.testing.assert_close(grads[param], ref, atol=1e-5, rtol=1e-4, msg=param)


def _op_calls(call, kwargs) -> collections.Counter:
    """Forward calls of adaptiveload ops in one forward of ``call`` (compiled already, in the grad mode
    it was compiled in: no recompile), as torch.profiler records them."""
    with profile() as prof:
        call(**kwargs)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("adaptiveload::"))


def _pattern_counts(report) -> dict:
    return {f"adaptiveload::{name}": report.of_pattern(name).fused for name in report.patterns()
            if report.of_pattern(name).fused}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_site_is_fused_and_training_matches_eager(name):
    """Whole-model compile: the report's fused sites and the ops one forward calls are the stated
    counts, nothing skipped or left to the plain patterns, and loss and every gradient match eager."""
    torch.manual_seed(0)
    model, kwargs, sites = MODELS[name]()
    ref_loss, ref_grads = _loss_and_grads(model, model, kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager"}, fullgraph=True)
    with collect_reports() as reports:
        loss, grads = _loss_and_grads(model, compiled, kwargs)

    (report,) = reports
    assert report.skipped == 0 and not report.deferred and _pattern_counts(report) == sites.whole, report.table()
    assert _op_calls(compiled, kwargs) == sites.whole
    if name.endswith("checkpointed"):
        assert sum(not c.graph.startswith("wrap_body") for c in report.chains) == 1  # the head
    _assert_matches_eager(loss, grads, ref_loss, ref_grads)


def _compile_blocks(model, paths):
    """Compile each block's forward on its own (the train job's regional compile)."""
    for path in paths:
        for block in model.get_submodule(path):
            block.forward = torch.compile(block.forward, backend="adaptiveload", options={"inner": "aot_eager"})


@pytest.mark.parametrize("name", [n for n in MODELS if not n.endswith("checkpointed")])
def test_per_block_compile_fuses_the_residuals_inside_each_block(name):
    """Per-block compile: the ops one forward calls are the stated per-block counts, and loss and
    every gradient match eager."""
    torch.manual_seed(0)
    model, kwargs, sites = MODELS[name]()
    ref_loss, ref_grads = _loss_and_grads(model, model, kwargs)

    torch._dynamo.reset()
    _compile_blocks(model, sites.blocks)
    loss, grads = _loss_and_grads(model, model, kwargs)

    assert _op_calls(model, kwargs) == sites.per_block
    _assert_matches_eager(loss, grads, ref_loss, ref_grads)


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
    assert report.skipped == 0 and _pattern_counts(report) == sites.whole, report.table()
    _assert_matches_eager(loss, grads, ref_loss, ref_grads)


# --- RMSNorm→modulate models --------------------------------------------------------------------
# Each factory returns (model, kwargs, {op: forward calls one forward makes}); the counts come from
# reading the diffusers 0.42.1 source, as commented. Their RMSNorms are diffusers' RMSNorm class
# (normalization.py), written out by hand: x * torch.rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True)
# + eps) [* weight]. Mochi, Lumina2 and Z-Image have graph breaks (several graphs, some compiled
# twice), so the fused calls are counted in one forward with torch.profiler, not from the counters.


def _ltx():
    # LTXVideoTransformer3DModel (transformers/transformer_ltx.py): each LTXVideoTransformerBlock runs
    #   self.norm1(hidden_states) * (1 + scale_msa) + shift_msa: on proj_in's output in block 0
    #     (plain), on the previous block's FFN residual after that                                 (1)
    #   hidden_states = hidden_states + attn_hidden_states * gate_msa; attn2 (cross attention) on
    #     hidden_states itself, no norm; hidden_states = hidden_states + attn_hidden_states
    #   self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp: residual                           (2)
    #   hidden_states = hidden_states + ff_output * gate_mlp
    # (norm1/norm2: RMSNorm(dim, elementwise_affine=False), weightless; attn.norm_q/norm_k are
    # torch.nn.RMSNorm feeding attention, not modulated)
    # head: self.norm_out(hidden_states) * (1 + scale) + shift, norm_out an nn.LayerNorm, on the last
    #   block's FFN residual                                                                     (+1 LN)
    # => RMSNorm: 1 plain, L (norm2) + L - 1 (norm1 of blocks 1..) = 2L - 1 residual; LayerNorm: 1 residual.
    model = diffusers.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                                 attention_head_dim=8, cross_attention_dim=16,
                                                 num_layers=NUM_LAYERS, caption_channels=16)
    kwargs = dict(hidden_states=torch.randn(2, 2 * 4 * 4, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5), num_frames=2,
                  height=4, width=4)
    L = NUM_LAYERS
    return model, kwargs, {RMS: 1, RES_RMS: 2 * L - 1, RES_ADALN: 1}


def _ltx2():
    # LTX2VideoTransformer3DModel (transformers/transformer_ltx2.py): each LTX2VideoTransformerBlock runs,
    # on the video and (audio_*) the audio stream alike:
    #   norm1 * (1 + scale_msa) + shift_msa: on the embedding in block 0 (plain), on the previous
    #     block's FFN residual after that                                                           (1)
    #   hidden_states = hidden_states + attn_hidden_states * gate_msa, then norm2: modulated only
    #     with cross_attn_mod (False here), a plain norm behind a residual                          (1)
    #   hidden_states = hidden_states + attn_hidden_states, then audio_to_video_norm(hidden_states)
    #     feeding two chains, * (1 + video_a2v_ca_scale) + ... and * (1 + video_v2a_ca_scale) + ...:
    #     one op cannot take both, so the residual is left and rms_norm_modulate fuses each         (2)
    #   hidden_states = hidden_states + a2v_gate * a2v_attn_hidden_states, then
    #     norm3 * (1 + scale_mlp) + shift_mlp: residual                                              (1)
    #   hidden_states = hidden_states + ff_output * gate_mlp
    # head: norm_out and audio_norm_out (nn.LayerNorm) * (1 + scale) + shift, on the FFN residuals (+2 LN)
    # => per stream: RMSNorm plain 1 (block 0's norm1) + 2L (the two-chain norm), residual
    #    L - 1 (norm1) + 2L (norm2, norm3) = 3L - 1; LayerNorm 1 residual.
    model = diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=NUM_LAYERS, caption_channels=16)
    kwargs = dict(hidden_states=torch.randn(2, 2 * 4 * 4, 8), audio_hidden_states=torch.randn(2, 6, 8),
                  encoder_hidden_states=torch.randn(2, 5, 16), audio_encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10.0, 500.0]), num_frames=2, height=4, width=4, audio_num_frames=6)
    L = NUM_LAYERS
    return model, kwargs, {RMS: 2 * (2 * L + 1), RES_RMS: 2 * (3 * L - 1), RES_ADALN: 2}


def _mochi():
    # MochiTransformer3DModel (transformers/transformer_mochi.py): each MochiTransformerBlock runs
    #   norm1 = MochiRMSNormZero: self.norm(hs.to(float32)) * (1 + scale_msa[:, None].to(float32))    (1)
    #   norm1_context: MochiRMSNormZero (1), or in the last block (context_pre_only)
    #     MochiLayerNormContinuous: MochiModulatedRMSNorm(x, 1 + scale.unsqueeze(1).to(float32))    (1)
    #   attention breaks the graph (MochiAttnProcessor2_0, attention_processor.py, takes each sample's
    #     text tokens with torch.nonzero): norm1 and norm1_context read a graph's inputs (plain)
    #   norm2 / norm4 (and their _context): MochiModulatedRMSNorm(x, tanh(gate)): a gate, no 1 + (0)
    #   hidden_states = hidden_states + self.norm2(attn, tanh(gate_msa).unsqueeze(1)), then
    #     norm3(hs, 1 + scale_mlp.unsqueeze(1).to(float32)): residual, the gated branch being
    #     norm2's output times tanh(gate)                                                          (1)
    #   norm3_context likewise (residual), except in the last block                              (1 / 0)
    # head: norm_out = AdaLayerNormContinuous (LayerNorm), after a graph break                 (+1 LN)
    # => RMSNorm: 2L plain (norm1, norm1_context), L + L - 1 = 2L - 1 residual (norm3, norm3_context);
    #    LayerNorm: 1 plain.
    model = diffusers.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8,
                                              num_layers=NUM_LAYERS, pooled_projection_dim=16, in_channels=4,
                                              text_embed_dim=16, time_embed_dim=4, max_sequence_length=16)
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 4, 4), encoder_hidden_states=torch.randn(2, 5, 16),
                  timestep=torch.tensor([10, 500]), encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))
    L = NUM_LAYERS
    return model, kwargs, {RMS: 2 * L, RES_RMS: 2 * L - 1, ADALN: 1}


def _lumina2():
    # Lumina2Transformer2DModel (transformers/transformer_lumina2.py): each Lumina2TransformerBlock with
    # modulation (noise_refiner and layers) runs
    #   norm1 = LuminaRMSNormZero: self.norm(x) * (1 + scale_msa[:, None]): on the embedding in the
    #     first block of each list (plain), on the previous block's FFN residual after that        (1)
    #   hidden_states = hidden_states + gate_msa.unsqueeze(1).tanh() * self.norm2(attn_output)
    #     (norm2: a gate, no 1 +), then self.ffn_norm1(hidden_states) * (1 + scale_mlp.unsqueeze(1)):
    #     residual                                                                                 (2)
    #   hidden_states = hidden_states + gate_mlp.unsqueeze(1).tanh() * self.ffn_norm2(mlp_output)
    # context_refiner's blocks (no modulation) run plain RMSNorms: ffn_norm1 on
    #   hidden_states + self.norm2(attn_output), and norm1 of blocks 1.. on the previous FFN residual:
    #   plain norms behind a residual
    # (RMSNorm(dim, eps) has a weight: the op gets it)
    # head: norm_out = LuminaLayerNormContinuous: self.norm(x) * (1 + scale)[:, None, :], on the last
    #   block's FFN residual                                                                     (+1 LN)
    # => R refiner blocks a list, L layers: RMSNorm 2 plain (the first norm1 of noise_refiner and of
    #    layers); residual R + L (ffn_norm1) + R - 1 + L - 1 (norm1) + R + R - 1 (context_refiner)
    #    = 4R + 2L - 3; LayerNorm 1 residual.
    model = diffusers.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32,
                                                num_layers=NUM_LAYERS, num_refiner_layers=1, num_attention_heads=4,
                                                num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 2, 2),
                                                axes_lens=(16, 16, 16), cap_feat_dim=16)
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([0.1, 0.5]),
                  encoder_hidden_states=torch.randn(2, 5, 16),
                  encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))
    R, L = 1, NUM_LAYERS
    return model, kwargs, {RMS: 2, RES_RMS: 4 * R + 2 * L - 3, RES_ADALN: 1}


def _z_image():
    # ZImageTransformer2DModel (transformers/transformer_z_image.py): each ZImageTransformerBlock with
    # modulation (noise_refiner and layers; no siglip) runs, with
    # scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp:
    #   self.attention_norm1(x) * scale_msa: on the embedding in the first block of each list
    #     (plain), on the previous block's FFN residual after that                                (1)
    #   x = x + gate_msa * self.attention_norm2(attn_out) (a gate, no 1 +), then
    #     self.ffn_norm1(x) * scale_mlp: residual                                                  (2)
    #   x = x + gate_mlp * self.ffn_norm2(...)
    # context_refiner's blocks (no modulation) run plain RMSNorms: ffn_norm1 on
    #   x + self.attention_norm2(attn_out), and attention_norm1 of blocks 1.. on the previous FFN
    #   residual: plain norms behind a residual
    # head: FinalLayer: self.norm_final(x) * scale, scale = 1.0 + ... (LayerNorm), on the last
    #   layer's FFN residual                                                                     (+1 LN)
    # => as Lumina2: RMSNorm 2 plain, 4R + 2L - 3 residual; LayerNorm 1 residual.
    model = diffusers.ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=NUM_LAYERS, n_refiner_layers=1,
                                               n_heads=4, n_kv_heads=4, cap_feat_dim=16, axes_dims=[4, 2, 2],
                                               axes_lens=[64, 32, 32])
    kwargs = dict(x=[torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)], t=torch.tensor([0.1, 0.5]),
                  cap_feats=[torch.randn(5, 16), torch.randn(5, 16)])
    R, L = 1, NUM_LAYERS
    return model, kwargs, {RMS: 2, RES_RMS: 4 * R + 2 * L - 3, RES_ADALN: 1}


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
