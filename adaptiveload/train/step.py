"""The training step that ``adaptiveload calibrate`` times and ``adaptiveload train`` runs.

One :class:`TrainStep` owns the model as it trains: moved to the device, sharded with FSDP2
(``fully_shard`` on every transformer block, then on the root) when there are several ranks,
compiled block by block with the chosen backend (regional compilation), and an AdamW optimizer.
A step is forward, the flow-matching loss, backward and the optimizer step, with bf16 autocast on
GPU (float32 on CPU).

Flow-matching (rectified-flow) loss, as used to train Wan 2.1 and SD3 (Lipman et al. 2023, "Flow
Matching for Generative Modeling"; Esser et al. 2024, "Scaling Rectified Flow Transformers", eq. 1
and §3.1): for clean latents x0, noise ε ~ N(0, I) and a noise level σ in (0, 1),

    x_σ = (1 − σ)·x0 + σ·ε,   the model sees (x_σ, timestep = 1000·σ, text) and predicts v,
    loss(sample) = mean over (C, T, H, W) of (v − (ε − x0))².

σ is drawn per sample by the dataset (:mod:`adaptiveload.train.data`), so a sample's noise does not
depend on which rank or batch it lands in.

Packs (policy ``packed``, a :class:`~adaptiveload.train.data.PackBatch`): the model's
``forward_packed`` runs the pack's samples as one token sequence (:func:`packed_flow_matching_loss`:
the same per-sample loss, each sample's mean over its own (C, T, H, W)), and a pack's loss is
multiplied by its weight: 0 for a padding pack (a rank without samples in an epoch's last step
trains one sample that counts nowhere, :meth:`~adaptiveload.sched.packing.PackingSampler.loss_weight`),
so ``N_global`` counts the samples of weight 1. The blocks see ``[1, sum S, dim]`` tokens and int32
boundaries ``[n + 1]``, marked dynamic, and the pack's ``n·L`` text tokens, which the model marks
unbacked (attention is an opaque op, :mod:`adaptiveload.models.packed`): the number of samples never
changes a graph, and ``sum S`` only through Inductor's size thresholds, whose graphs the job's
warm-up compiles (:func:`~adaptiveload.train.loop.warm_up_packs`).

Unequal batches across ranks: each rank's loss is ``W · Σ_local loss(sample) / N_global`` where
``N_global`` is the number of samples in the whole step (all ranks, all-reduced by the caller).
FSDP2 averages gradients over the W ranks, so the applied gradient is ``Σ_all ∇loss(sample) /
N_global``: every sample has the same weight wherever it landed — the same gradient a single
process computes on all the step's samples.

Dynamic sequence length: the batch, frame, height and width dims of the inputs are marked dynamic
and equal sizes get separate symbols (no "duck shapes"), so most new bucket shapes do not
recompile. Sizes of 1 are still specialised (torch's 0/1 rule): B = 1 adds a graph of each compiled
block (a model compiled whole also adds graphs for single-frame batches), and Inductor adds a few
size thresholds (e.g. on B·S); the job's warm-up runs every kind of batch, so all are compiled
before timing. Tracing with
``backed_size_oblivious`` instead would avoid those but made Inductor guard on every sequence length
(a recompile per bucket) and, under FSDP2 on torch 2.11, bake the first sequence length into the
strides of saved activations (pytorch/pytorch#191885).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from adaptiveload.train.distributed import DistContext

logger = logging.getLogger("adaptiveload.train")

BACKENDS = ("adaptiveload", "inductor", "aot_eager", "eager")
INNER_COMPILERS = ("inductor", "aot_eager", "eager")

try:  # torch >= 2.6 exports FSDP2 here; older releases keep it under _composable
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
except ImportError:  # pragma: no cover - depends on the torch release
    from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method


class NonFiniteStep(RuntimeError):
    """A training step produced a non-finite loss or gradient; its optimizer step was skipped."""


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a gradient (FSDP2 keeps them as DTensors), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class InputSpec:
    """What one sample looks like to the model.

    Attributes:
        in_channels: latent channels C.
        text_len, text_dim: text-embedding tokens L and channels (context is [L, text_dim]).
        patch_size: (pt, ph, pw); a latent (T, H, W) has S = T/pt · H/ph · W/pw tokens.
    """

    in_channels: int
    text_len: int
    text_dim: int
    patch_size: tuple[int, int, int]

    @classmethod
    def from_model(cls, model: nn.Module) -> "InputSpec":
        """Read the spec from ``model.config`` (a ``WanConfig`` or an object with the same fields).

        Raises:
            ValueError: the model has no ``config``, the config lacks a field (named), or its
                ``patch_size`` is not three positive ints -- e.g. the int of diffusers' Flux,
                HunyuanVideo and CogVideoX (the message says what to wrap).
        """
        name = type(model).__name__
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(
                f"model {name} has no .config; a custom model needs a config with in_channels, "
                "text_len, text_dim and patch_size"
            )
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        patch = get("patch_size")
        if isinstance(patch, int) and not isinstance(patch, bool):
            pt = get("patch_size_t") or 1
            raise ValueError(
                f"model {name}: config.patch_size is the int {patch} (a spatial patch), but the train step feeds "
                f"video latents [B, C, T, H, W]: wrap the model in an nn.Module whose config.patch_size is "
                f"(pt, ph, pw), e.g. ({pt}, {patch}, {patch}), and whose forward(latents, timestep, context) "
                "patchifies and returns [B, C, T, H, W] (adaptiveload.train.diffusers_wan wraps diffusers' Wan)")
        values = {
            "in_channels": get("in_channels"),
            "text_len": get("text_len", 512),
            "text_dim": get("text_dim"),
            "patch_size": tuple(patch or ()),
        }
        missing = [key for key, value in values.items() if value in (None, ())]
        if missing:
            raise ValueError(f"model {name}: config lacks {', '.join(missing)}")
        if len(values["patch_size"]) != 3 or not all(isinstance(v, int) and v >= 1 for v in values["patch_size"]):
            raise ValueError(f"model {name}: config.patch_size must be three positive ints (pt, ph, pw), "
                             f"got {patch!r}")
        return cls(**values)


@dataclass(frozen=True)
class StepConfig:
    """How the step runs.

    Attributes:
        backend: ``"adaptiveload"`` (the fused backend), ``"inductor"`` (plain ``torch.compile``),
            ``"aot_eager"`` (compile without code generation; cheap, for tests), ``"eager"`` (no compile).
        inner: the compiler the adaptiveload backend hands the rewritten graph to.
        learning_rate, weight_decay, betas: AdamW's.
        fsdp: shard with FSDP2; ``None`` means "when there are several ranks".
        activation_checkpointing: recompute each transformer block's activations in backward
            (:func:`checkpoint_blocks`); a model without a list of blocks must offer
            ``set_activation_checkpointing(bool)``.
    """

    backend: str = "adaptiveload"
    inner: str = "inductor"
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    fsdp: Optional[bool] = None
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"unknown inner compiler {self.inner!r}; choose one of {', '.join(INNER_COMPILERS)}")
        if not self.learning_rate >= 0:
            raise ValueError(f"learning rate must be >= 0, got {self.learning_rate}")

    def describe(self) -> str:
        """``"adaptiveload(inductor)"``, ``"inductor"``, ... for reports."""
        return f"adaptiveload({self.inner})" if self.backend == "adaptiveload" else self.backend


def load_model(
    preset: Optional[str] = None,
    factory: Optional[str] = None,
    num_layers: Optional[int] = None,
    patch_size: Optional[tuple] = None,
) -> nn.Module:
    """Build the model to train: a reference preset, or the user's ``MODULE:FACTORY``.

    Args:
        preset: a name in ``adaptiveload.models.PRESETS``.
        factory: ``"package.module:function"`` or ``"path/to/file.py:function"`` (as ``adaptiveload
            inspect`` takes it; the current directory is on the import path); the function is called
            with no arguments and must return an ``nn.Module`` called as ``model(latents, timestep,
            context)`` with a ``config`` (see :class:`InputSpec`).
        num_layers: keep only this many transformer blocks (presets only; e.g. a 10-layer cut).
            Activation checkpointing is the step's (``StepConfig.activation_checkpointing``).
        patch_size: the preset's (pt, ph, pw) patch instead of its own (presets only; a factory's
            model has its own).

    Raises:
        ValueError: unknown preset (lists them), a malformed or unimportable factory, a factory that
            returns something that is not an ``nn.Module``, or both/neither of preset and factory.
    """
    from adaptiveload.models import build_model
    from adaptiveload.models.config import resolve_config

    if (preset is None) == (factory is None):
        raise ValueError("give exactly one of a preset (--preset) and a model factory (--model MODULE:FACTORY)")
    if factory is not None:
        from adaptiveload.fxfuse.cli import load_factory

        try:
            fn = load_factory(factory)
        except ValueError as err:
            raise ValueError(f"--model {factory}: {err}") from None
        model = fn()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {factory} returned {type(model).__name__}, not an nn.Module")
        return model
    config = resolve_config(preset)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
        config = dataclasses.replace(config, num_layers=num_layers)
    if patch_size is not None:
        config = dataclasses.replace(config, patch_size=tuple(patch_size))
    return build_model(config)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: ``model.blocks``, else the longest ``ModuleList``."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def flow_matching_loss(model, latents: Tensor, context: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """Per-sample rectified-flow loss (see the module docstring for the formula and sources).

    Args:
        model: called as ``model(x_sigma, timestep, context)``.
        latents: clean latents x0 [B, C, T, H, W].
        context: text embeddings [B, L, text_dim].
        noise: ε [B, C, T, H, W].
        sigma: noise level [B] in (0, 1); the model's timestep is ``1000·σ``.

    Returns:
        float32 [B]: mean squared error of each sample's prediction against ``ε − x0``.
    """
    s = sigma.to(latents.dtype).view(-1, *([1] * (latents.dim() - 1)))
    noisy = (1 - s) * latents + s * noise
    prediction = model(noisy, 1000.0 * sigma.float(), context)
    target = noise - latents
    return (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def packed_flow_matching_loss(forward_packed, tokens: Tensor, context: Tensor, noise: Tensor, sigma: Tensor,
                              grid: Tensor, cu_seqlens: Tensor, segment_ids: Tensor) -> Tensor:
    """Per-sample rectified-flow loss of a pack (:func:`flow_matching_loss` for samples of different shapes).

    Args:
        forward_packed: called as ``forward_packed(x_sigma_tokens, timestep [n], context, grid, cu_seqlens)``
            (:meth:`~adaptiveload.models.WanDiT.forward_packed`), returning tokens shaped like its input.
        tokens, noise: clean latents x0 and ε, patchified: [sum S_i, F] (F = C*pt*ph*pw).
        context: [n, L, text_dim]; sigma: [n] noise levels in (0, 1).
        grid: int [n, 3] tokens per axis; cu_seqlens: int32 [n + 1]; segment_ids: int [sum S_i], the
            sample of every token (on the tokens' device).

    Returns:
        float32 [n]: each sample's mean over its S_i * F values of ``(v - (ε - x0))²``.
    """
    s = sigma.to(tokens.dtype)[segment_ids].unsqueeze(1)
    noisy = (1 - s) * tokens + s * noise
    prediction = forward_packed(noisy, 1000.0 * sigma.float(), context, grid, cu_seqlens)
    squared = (prediction.float() - (noise - tokens).float()).pow(2).sum(dim=1)  # [sum S]
    sums = squared.new_zeros(sigma.shape[0]).index_add_(0, segment_ids, squared)
    values = (torch.diff(cu_seqlens).to(torch.float32) * tokens.shape[1]).to(sums.device, non_blocking=True)
    return sums / values


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Activation checkpointing of every block, taken inside the block's ``forward``.

    ``block.forward`` becomes ``checkpoint(forward, ..., use_reentrant=False)`` (while grad is
    enabled), so a block's compiled region (:meth:`TrainStep._compile_forward`) holds the checkpoint:
    Dynamo traces it as one higher-order op and the recomputation runs inside the compiled backward.
    A checkpoint taken around the block call instead (the model's own switch) re-enters the compiled
    forward in backward, where FSDP2's inputs are no longer views; Dynamo's guards on their bases
    then fail, the recomputation recompiles a different graph, and torch.utils.checkpoint raises
    CheckpointError (different saved tensors). So the model's own switch is turned off here. FSDP2's
    hooks stay outside the checkpoint, as torchtitan orders them (checkpoint, compile, shard).

    ``block.forward`` is replaced in place (one :class:`TrainStep` per model instance). A model
    without ``set_activation_checkpointing`` keeps whatever checkpointing it does itself (e.g.
    diffusers' ``enable_gradient_checkpointing()`` on a raw diffusers model): turn that off.

    Args:
        model: the whole model; its ``set_activation_checkpointing(bool)`` is used when it has no blocks.
        blocks: :func:`transformer_blocks` of ``model``.

    Raises:
        ValueError: no blocks and no ``set_activation_checkpointing``.
    """
    switch = getattr(model, "set_activation_checkpointing", None)
    if not blocks:
        if switch is None:
            raise ValueError(f"model {type(model).__name__} has no list of blocks and no "
                             "set_activation_checkpointing(); configure checkpointing in the factory")
        switch(True)
        return
    if switch is not None:
        switch(False)
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _block_inputs_dynamic(module, args):
    """Forward pre-hook of a compiled block: contiguous tensor inputs (also inside tuples and lists,
    e.g. diffusers' rotary (cos, sin)) with every dim but the channel (last) dim marked dynamic, so
    every block and every bucket reuse the same graphs (the first block otherwise receives a
    transposed view from the patch embedding, the others do not); 1-D integer inputs (a pack's
    boundaries ``cu_seqlens`` [n + 1]) have their one dim marked dynamic, so packs of any n share them.
    A dim the caller marked unbacked stays unbacked (Dynamo ranks that mark first)."""

    def prepare(arg):
        if isinstance(arg, (tuple, list)):
            return type(arg)(prepare(a) for a in arg)
        if isinstance(arg, Tensor) and arg.dim() >= 2:
            arg = arg.contiguous()
            torch._dynamo.maybe_mark_dynamic(arg, list(range(arg.dim() - 1)))
        elif isinstance(arg, Tensor) and arg.dim() == 1 and not arg.is_floating_point():
            torch._dynamo.maybe_mark_dynamic(arg, 0)
        return arg

    return prepare(tuple(args))


def _distinct_symbols():
    """Trace equal sizes (e.g. H == W of the first bucket) as separate symbols, where this torch has
    the switch, so a later bucket with H != W does not recompile."""
    config = torch.fx.experimental._config
    return config.patch(use_duck_shape=False) if hasattr(config, "use_duck_shape") else contextlib.nullcontext()


def _run_eagerly():
    """Run compiled functions as plain Python (``torch.compiler.set_stance("force_eager")``, torch >= 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class TrainStep:
    """A model ready to train: placed, sharded, compiled, with its optimizer.

    Args:
        model: the ``nn.Module`` (parameters float32); moved to ``ctx.device``.
        config: :class:`StepConfig`.
        ctx: :class:`DistContext` (rank, world size, device).

    Attributes:
        module: the (possibly FSDP2-sharded) module, its blocks' forwards compiled; evaluation runs
            it eagerly.
        compiled: what a training step calls: ``module`` with each block's forward compiled, or the
            whole module compiled when it has no list of blocks (``module`` itself for the eager backend).
        optimizer: ``torch.optim.AdamW``.
        sharded: whether FSDP2 wraps the model.
        regions: compiled regions one forward runs (the number of blocks, or 1 for a whole-model compile).
    """

    def __init__(self, model: nn.Module, config: StepConfig, ctx: DistContext):
        self.config = config
        self.ctx = ctx
        self.device = ctx.device
        self.module = model.to(ctx.device)
        self.module.train()
        self.sharded = ctx.distributed if config.fsdp is None else bool(config.fsdp)
        # Regional compilation: each block's forward is compiled, and every block reuses the same
        # graphs (compile time does not grow with depth); the root's own layers (embeddings, head)
        # stay eager. Under FSDP2 this also keeps its hooks (all-gathers) outside the graphs
        # (compiling the whole FSDP2 model breaks the graph at every hook and recompiles per shape).
        # A model without a list of blocks is compiled whole.
        blocks = transformer_blocks(self.module)
        if config.activation_checkpointing:
            checkpoint_blocks(self.module, blocks)
        for block in blocks:
            self._compile_forward(block)
            if self.sharded:
                fully_shard(block)
        if self.sharded:
            fully_shard(self.module)
            if callable(getattr(self.module, "forward_packed", None)):  # FSDP2 hooks on it too (root all-gather)
                register_fsdp_forward_method(self.module, "forward_packed")
        self.compiled = self.module if blocks else self._compile(self.module)
        self.regions = len(blocks) or 1
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
        )
        # FSDP2 divides the summed gradients by the world size; multiply the loss back (module docstring).
        self.loss_scale = float(ctx.world_size) if self.sharded else 1.0

    def _compile_options(self) -> dict:
        cfg = self.config
        if cfg.backend == "adaptiveload":
            # the callable itself, not the name: works without the package's entry point installed
            from adaptiveload.fxfuse.backend import adaptiveload_backend

            return {"backend": adaptiveload_backend, "options": {"inner": cfg.inner, "fuse": True}}
        return {"backend": cfg.backend}

    def _compile(self, module: nn.Module):
        if self.config.backend == "eager":
            return module
        return torch.compile(module, **self._compile_options())

    def _compile_forward(self, module: nn.Module) -> None:
        """Compile ``module.forward`` only, so hooks (FSDP2's all-gathers) stay outside the graph."""
        if self.config.backend != "eager":
            module.register_forward_pre_hook(_block_inputs_dynamic)
            module.forward = torch.compile(module.forward, **self._compile_options())

    def autocast(self):
        """bf16 autocast on CUDA; nothing (float32) on CPU."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _inputs(self, batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        to = dict(device=self.device, non_blocking=True)
        return batch.latents.to(**to), batch.context.to(**to), batch.noise.to(**to), batch.sigma.to(**to)

    def _call_compiled(self, latents: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
        """The compiled model, with batch, frame, height and width marked dynamic (module docstring)."""
        torch._dynamo.maybe_mark_dynamic(latents, [0, 2, 3, 4])
        torch._dynamo.maybe_mark_dynamic(timestep, 0)
        torch._dynamo.maybe_mark_dynamic(context, 0)
        return self.compiled(latents, timestep, context)

    def _pack_loss(self, pack) -> Tensor:
        """Per-sample losses [n] of a :class:`~adaptiveload.train.data.PackBatch` through the model's
        ``forward_packed`` (its blocks compiled; the boundaries stay on the CPU, read on the host)."""
        to = dict(device=self.device, non_blocking=True)
        tokens, context, noise, sigma = (t.to(**to) for t in (pack.tokens, pack.context, pack.noise, pack.sigma))
        with _distinct_symbols(), self.autocast():
            return packed_flow_matching_loss(self.module.forward_packed, tokens, context, noise, sigma, pack.grid,
                                             pack.layout.cu_seqlens, pack.layout.segment_ids.to(**to))

    def forward_backward(self, batch, global_num_samples: int, weight: float = 1.0) -> Tensor:
        """Forward, loss and backward for this rank's batch; gradients accumulate into ``.grad``.

        Args:
            batch: a :class:`adaptiveload.train.data.Batch` (one latent shape) or a
                :class:`adaptiveload.train.data.PackBatch` (a pack, for a model with ``forward_packed``).
            global_num_samples: samples of weight 1 in the whole step, summed over ranks (the loss normaliser).
            weight: 1, or 0 for a padding pack (its backward runs, its gradients are zero).

        Returns:
            float32 scalar (detached): ``weight`` times the sum of this rank's per-sample losses.

        Raises:
            ValueError: ``global_num_samples`` smaller than this rank's counted samples.
        """
        counted = len(batch) if weight > 0 else 0
        if global_num_samples < counted:
            raise ValueError(f"global_num_samples {global_num_samples} < this rank's batch size {counted}")
        if hasattr(batch, "layout"):  # a PackBatch
            per_sample = self._pack_loss(batch)
        else:
            latents, context, noise, sigma = self._inputs(batch)
            with _distinct_symbols(), self.autocast():
                per_sample = flow_matching_loss(self._call_compiled, latents, context, noise, sigma)
        loss_sum = per_sample.sum() * weight
        (loss_sum * (self.loss_scale / global_num_samples)).backward()
        return loss_sum.detach()

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (AdamW) and clear them."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def check_finite(self, loss_sum: Tensor) -> None:
        """Raise before the optimizer step if the loss or the norm of this rank's gradients is not finite
        (a gradient holding inf/NaN, or finite gradients whose norm overflows).

        AdamW would spread one NaN gradient into the weights (even at learning rate 0: 0·NaN = NaN),
        so the step is refused instead and the weights stay as they were. One norm over the local
        gradient shards (``torch.nn.utils.get_total_norm``) and one host sync per step.

        Raises:
            NonFiniteStep: naming the loss and up to three parameters with non-finite gradients
                (or saying that the gradients' norm overflowed); the gradients are cleared.
        """
        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        finite = torch.isfinite(loss_sum)
        if grads:
            finite = finite & torch.isfinite(torch.nn.utils.get_total_norm(grads).to(finite.device))
        if bool(finite):
            return
        bad = [name for name, p in self.module.named_parameters()
               if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]
        self.optimizer.zero_grad(set_to_none=True)
        if bad:
            where = f"; non-finite gradients in {len(bad)} parameter(s): {', '.join(bad[:3])}"
        elif grads and bool(torch.isfinite(loss_sum)):
            where = "; every gradient is finite, but their norm overflows (some gradients are huge)"
        else:
            where = ""
        raise NonFiniteStep(f"loss {float(loss_sum):.6g}{where}; the optimizer step was skipped")

    def __call__(self, batch, global_num_samples: int, weight: float = 1.0) -> Tensor:
        """One full training step (forward, loss, backward, optimizer); returns the local loss sum
        (:meth:`forward_backward`'s arguments).

        Raises:
            NonFiniteStep: the loss or a gradient is not finite (the weights are left unchanged).
        """
        loss_sum = self.forward_backward(batch, global_num_samples, weight)
        self.check_finite(loss_sum)
        self.optimizer_step()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, batch) -> Tensor:
        """Per-sample flow-matching loss [B] (float32, on CPU) of ``batch`` under the current weights.

        Runs the module eagerly (its compiled blocks too: the same computation for every backend,
        and no inference graphs to compile) in the training dtype policy, so evaluation losses are
        comparable across backends and samplers.
        """
        latents, context, noise, sigma = self._inputs(batch)
        with _run_eagerly(), self.autocast():
            return flow_matching_loss(self.module, latents, context, noise, sigma).cpu()

    @contextlib.contextmanager
    def frozen_weights(self):
        """Run real steps without changing the model: learning rate 0 inside, optimizer state reset after.

        AdamW with lr = 0 does all the work of a step (so timings and compiled graphs are the
        training ones) but leaves every parameter unchanged (its decay term is ``lr·wd·p``) — for
        finite gradients; a step with non-finite ones is refused by :meth:`check_finite`, since
        0·NaN = NaN.
        """
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        try:
            yield self
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.state.clear()

    def synchronize(self) -> None:
        """Wait for this rank's queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory_bytes(self) -> int:
        """Peak device memory allocated since the last :meth:`reset_peak_memory` (0 on CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return 0

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
