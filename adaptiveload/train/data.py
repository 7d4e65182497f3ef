"""Training samples: latents of each sample's shape, text embeddings, noise, σ.

:class:`LatentDataset` maps a sample index to a dict of tensors. Latents and text embeddings are
random by default (synthetic data: throughput runs need no disk I/O), or read from the files a
manifest names (:class:`SampleFiles`), or come from any user loader; noise ε and the noise level σ
are drawn per (seed, epoch, index), so a sample gets the same noise whichever rank, batch or worker
process handles it — a two-rank run and a one-process run on the same samples see identical inputs.

Sample files (:class:`SampleFiles`): a latent file holds one tensor [C, T, H, W], a text file one
tensor [L, text_dim] with 1 <= L <= the model's text length (:func:`collate` pads it with zeros, as
Wan pads prompts to 512 tokens). A ``.safetensors`` file (needs ``pip install
safetensors``) holds one tensor, or several with the key ``latent`` / ``text``; a
``.pt`` file is read with ``torch.load(weights_only=True)`` and holds a tensor or a dict of them (the
same rule). Any floating dtype is read and converted to float32. Each tensor is checked against its
manifest row's shape; a missing, unreadable or mismatched file raises :class:`SampleError` naming
the row and the path.

Where draws happen: on the CPU (``LatentDataset``'s default; in DataLoader workers, then pinned and
copied), or on the training device itself (``device="cuda"``, what ``adaptiveload train`` does
unless ``--workers`` is given) — a GPU draws a batch's random tensors in microseconds,
where one CPU core spends about 15 ms per sample of the Wan shapes (its 512 x 4096 float32 text
embedding), then pins and copies it. The same seed gives the same values on every device of one
type; CPU and CUDA draws differ.

σ sampling: ``"logit_normal"`` (default) draws σ = sigmoid(n), n ~ N(0, 1) — the logit-normal
schedule of Esser et al. 2024 ("Scaling Rectified Flow Transformers", §3.1, m = 0, s = 1), which
weights middle noise levels; ``"uniform"`` draws σ ~ U(0, 1) (plain rectified flow).

:func:`collate` stacks samples of one latent shape into a :class:`Batch`; :func:`collate_pack` puts
samples of any shapes into one :class:`PackBatch` (policy ``packed``), their latents and noise
patchified and concatenated into one token sequence.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from adaptiveload.models.packed import patchify_packed
from adaptiveload.sched.packing import PackedBatch, collate_packed
from adaptiveload.train.step import InputSpec

SIGMA_SAMPLING = ("logit_normal", "uniform")

# A sample loader maps (index, latent_shape (T, H, W)) to (latents [C, T, H, W], context [L, text_dim]).
SampleLoader = Callable[[int, tuple], tuple]


class SampleError(ValueError):
    """A sample's file is missing, unreadable, or not the tensor its manifest row describes (the
    message, one line, names the manifest, the row and the path)."""


def latent_problem(tensor, expected: tuple) -> Optional[str]:
    """Why ``tensor`` is not a latent of size ``expected`` ([C, T, H, W]), or None."""
    return _tensor_problem(tensor) or (None if tuple(tensor.shape) == tuple(expected) else
                                       f"shape {list(tensor.shape)}, expected [C, T, H, W] = {list(expected)}")


def text_problem(tensor, spec: InputSpec) -> Optional[str]:
    """Why ``tensor`` is not a text embedding [L, text_dim] with 1 <= L <= ``spec.text_len``, or None."""
    problem = _tensor_problem(tensor)
    if problem is None and (tensor.dim() != 2 or tensor.shape[1] != spec.text_dim or
                            not 1 <= tensor.shape[0] <= spec.text_len):
        problem = (f"shape {list(tensor.shape)}, expected [L, {spec.text_dim}] with 1 <= L <= {spec.text_len} "
                   "(the model's text length and width)")
    return problem


def _tensor_problem(tensor) -> Optional[str]:
    if not isinstance(tensor, Tensor):
        return f"holds a {type(tensor).__name__}, not a tensor"
    if not tensor.is_floating_point():
        return f"dtype {tensor.dtype}, expected a floating-point tensor"
    bad = int((~torch.isfinite(tensor)).sum())
    return f"{bad:,} of {tensor.numel():,} values are not finite" if bad else None


def file_problem(path: str) -> Optional[str]:
    """What stops ``path`` from being read without opening it: another file type than ``.safetensors``
    / ``.pt``, no such file, or safetensors not installed; ``None`` when it can be read."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".safetensors", ".pt"):
        return f"unknown file type {ext!r}: expected .safetensors or .pt"
    if not os.path.isfile(path):
        return "no such file"
    if ext == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        return "reading .safetensors needs the safetensors package (pip install safetensors)"
    return None


def read_tensor(path: str, key: str) -> Tensor:
    """The tensor in a ``.safetensors`` or ``.pt`` file: its only tensor, or the one under ``key``.

    Raises:
        SampleError: no such file, another file type, safetensors not installed, an unreadable file,
            or a file of several tensors without ``key`` (the message is the problem alone; callers
            add the row and path).
    """
    problem = file_problem(path)
    if problem is not None:
        raise SampleError(problem)
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".safetensors":
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                pick = names[0] if len(names) == 1 else key
                contents = {pick: f.get_tensor(pick)} if pick in names else dict.fromkeys(names)
        else:
            contents = torch.load(path, map_location="cpu", weights_only=True)
    except SampleError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is the file's problem, named with its path
        text = str(err).splitlines()[0][:200] if str(err) else ""
        raise SampleError(f"cannot read it ({type(err).__name__}: {text})") from None
    if isinstance(contents, dict):
        if len(contents) == 1:
            (contents,) = contents.values()
        elif key in contents:
            contents = contents[key]
        else:
            raise SampleError(f"holds {len(contents)} entries ({', '.join(map(str, list(contents)[:5]))}): expected "
                              f"one tensor or the key {key!r}")
    return contents


class SampleFiles:
    """A :data:`SampleLoader` reading each sample's latent and text embedding from its files (module
    docstring), e.g. the ``latent_path`` / ``text_path`` columns of a manifest.

    Args:
        latent_paths, text_paths: [n] file paths, one per sample (index i is manifest row i + 1).
        spec: the model's :class:`InputSpec` (channels, text length and width).
        source: the manifest, for messages.

    Calling it with ``(index, (T, H, W))`` returns ``(latents float32 [C, T, H, W], context float32
    [L, text_dim])`` on the CPU.

    Raises:
        SampleError: (when called) naming the manifest, row and path: no such file, unreadable, not a
            floating-point tensor, non-finite values, or a shape other than the row's.
    """

    def __init__(self, latent_paths, text_paths, spec: InputSpec, source: str):
        self.latent_paths, self.text_paths = list(latent_paths), list(text_paths)
        self.spec, self.source = spec, source

    def check_present(self) -> None:
        """Before any step: every file exists, has a known type, and safetensors is installed where
        needed (:func:`file_problem`; reading and checking the tensors stays with the loader).

        Raises:
            SampleError: naming the manifest, the first bad row, its path and problem, and how many
                more files are bad.
        """
        problems = [f"row {index + 1}: {kind} file {path}: {problem}"
                    for index, paths in enumerate(zip(self.latent_paths, self.text_paths))
                    for kind, path in zip(("latent", "text"), paths)
                    if (problem := file_problem(path)) is not None]
        if problems:
            more = f" (and {len(problems) - 1} more bad file(s))" if len(problems) > 1 else ""
            raise SampleError(f"{self.source}: {problems[0]}{more}")

    def __call__(self, index: int, shape: tuple) -> tuple[Tensor, Tensor]:
        latent_size = (self.spec.in_channels, *shape)
        tensors = []
        for kind, path, check in (("latent", self.latent_paths[index], lambda t: latent_problem(t, latent_size)),
                                  ("text", self.text_paths[index], lambda t: text_problem(t, self.spec))):
            where = f"{self.source}: row {index + 1}: {kind} file {path}"
            try:
                tensor = read_tensor(path, kind)
            except SampleError as err:
                raise SampleError(f"{where}: {err}") from None
            problem = check(tensor)
            if problem is not None:
                raise SampleError(f"{where}: {problem}")
            tensors.append(tensor.float())
        return tensors[0], tensors[1]


def sample_error_message(err: BaseException) -> str:
    """The one-line message of a :class:`SampleError`, also when a DataLoader worker re-raised it
    (whose message then holds the worker's traceback, the original message on its last line)."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    return last.split(f"{SampleError.__name__}: ", 1)[-1]


def _generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` seeded from integer keys (numpy's SeedSequence mixes them)."""
    seed = int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(seed)


def sample_sigma(generator: torch.Generator, n: int, sampling: str = "logit_normal") -> Tensor:
    """Draw ``n`` noise levels in (0, 1) (float32 [n]); see the module docstring for the schedules.

    Raises:
        ValueError: unknown ``sampling``.
    """
    if sampling == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator, device=generator.device))
    if sampling == "uniform":
        return torch.rand(n, generator=generator, device=generator.device)
    raise ValueError(f"unknown sigma sampling {sampling!r}; choose one of {', '.join(SIGMA_SAMPLING)}")


class LatentDataset(torch.utils.data.Dataset):
    """Samples of given latent shapes for the flow-matching step.

    Args:
        latent_shapes: int [n, 3] (T, H, W) latent grid of every sample (e.g. ``Manifest.latent_shapes``).
        spec: :class:`InputSpec` (channels, text length and width).
        seed: base seed of every random draw.
        sigma_sampling: ``"logit_normal"`` or ``"uniform"``.
        loader: optional ``loader(index, (T, H, W)) -> (latents [C, T, H, W], context [L, text_dim])``
            supplying real data (e.g. :class:`SampleFiles`; ``1 <= L <= text_len``); random N(0, 1)
            tensors otherwise (throughput runs need no disk I/O; ``L = text_len``).
        device: where the random tensors are drawn and every item's tensors live (default CPU). A
            CUDA device needs a DataLoader without worker processes (``num_workers=0``).

    Items are dicts: ``index`` (int), ``latents`` float32 [C, T, H, W], ``context`` float32
    [L, text_dim], ``noise`` float32 [C, T, H, W], ``sigma`` float32 scalar tensor, all on ``device``.

    Raises:
        ValueError: shapes not [n, 3] positive integers; a loader returning tensors of the wrong
            shape (named, with the sample index).
        SampleError: from :class:`SampleFiles`, naming the row and the file.
    """

    def __init__(
        self,
        latent_shapes,
        spec: InputSpec,
        seed: int = 0,
        sigma_sampling: str = "logit_normal",
        loader: Optional[SampleLoader] = None,
        device: torch.device | str = "cpu",
    ):
        shapes = np.asarray(latent_shapes, dtype=np.int64)
        if shapes.ndim != 2 or shapes.shape[1] != 3 or (shapes.size and shapes.min() < 1):
            raise ValueError(f"latent_shapes must be positive integers [n, 3] (T, H, W), got array of shape {shapes.shape}")
        if sigma_sampling not in SIGMA_SAMPLING:
            raise ValueError(f"unknown sigma sampling {sigma_sampling!r}; choose one of {', '.join(SIGMA_SAMPLING)}")
        self.latent_shapes = shapes
        self.spec = spec
        self.seed = int(seed)
        self.sigma_sampling = sigma_sampling
        self.loader = loader
        self.device = torch.device(device)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.latent_shapes)

    def set_epoch(self, epoch: int) -> None:
        """Draw fresh noise and σ for every sample in ``epoch`` (the clean latents stay the same)."""
        self.epoch = int(epoch)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        shape = tuple(int(v) for v in self.latent_shapes[index])
        latent_size = (self.spec.in_channels, *shape)
        context_size = (self.spec.text_len, self.spec.text_dim)
        if self.loader is not None:
            latents, context = self.loader(index, shape)
            for name, problem in (("latents", latent_problem(latents, latent_size)),
                                  ("context", text_problem(context, self.spec))):
                if problem is not None:
                    raise ValueError(f"sample loader: {name} of sample {index}: {problem}")
            latents, context = latents.to(self.device, torch.float32), context.to(self.device, torch.float32)
        else:
            data_gen = _generator(self.device, self.seed, index)
            latents = torch.randn(latent_size, generator=data_gen, device=self.device)
            context = torch.randn(context_size, generator=data_gen, device=self.device)
        noise_gen = _generator(self.device, self.seed, self.epoch, index, 1)
        noise = torch.randn(latent_size, generator=noise_gen, device=self.device)
        sigma = sample_sigma(noise_gen, 1, self.sigma_sampling)[0]
        return {"index": index, "latents": latents, "context": context, "noise": noise, "sigma": sigma}


@dataclass
class Batch:
    """Samples of one latent shape, stacked.

    Attributes:
        indices: int64 [B] sample indices.
        latents: [B, C, T, H, W]; noise: [B, C, T, H, W]; context: [B, L, text_dim] (zero-padded to
            one L); sigma: [B].
    """

    indices: Tensor
    latents: Tensor
    context: Tensor
    noise: Tensor
    sigma: Tensor

    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(T, H, W) of every sample in the batch."""
        return tuple(int(v) for v in self.latents.shape[2:])

    def pin_memory(self) -> "Batch":
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this)."""
        return Batch(*(t.pin_memory() for t in (self.indices, self.latents, self.context, self.noise, self.sigma)))


def collate(samples: Sequence[dict], text_len: Optional[int] = None) -> Batch:
    """Stack dataset items of one latent shape into a :class:`Batch`; each text embedding [L, D] is
    zero-padded at the end to ``text_len`` tokens (default: the batch's longest), as Wan pads prompts.

    Raises:
        ValueError: an empty list, items of different latent shapes (named with their indices), or a
            text embedding longer than ``text_len``.
    """
    if not samples:
        raise ValueError("collate: empty batch")
    shapes = {tuple(s["latents"].shape) for s in samples}
    if len(shapes) > 1:
        listing = ", ".join(f"{s['index']}: {list(s['latents'].shape[1:])}" for s in samples)
        raise ValueError(f"collate: a batch must hold one latent shape, got samples {listing}")
    return Batch(
        indices=torch.tensor([s["index"] for s in samples], dtype=torch.int64),
        latents=torch.stack([s["latents"] for s in samples]),
        context=_stack_text(samples, text_len, "collate"),
        noise=torch.stack([s["noise"] for s in samples]),
        sigma=torch.stack([s["sigma"] for s in samples]),
    )


def _stack_text(samples: Sequence[dict], text_len: Optional[int], caller: str) -> Tensor:
    """[n, L, text_dim]: the items' text embeddings zero-padded at the end to ``text_len`` tokens
    (default: the longest); ValueError naming the samples whose text is longer."""
    length = text_len or max(int(s["context"].shape[0]) for s in samples)
    longer = [s["index"] for s in samples if s["context"].shape[0] > length]
    if longer:
        raise ValueError(f"{caller}: text embeddings of samples {longer} are longer than {length} tokens")
    return torch.stack([torch.nn.functional.pad(s["context"], (0, 0, 0, length - s["context"].shape[0]))
                        for s in samples])


@dataclass
class PackBatch:
    """Samples of any latent shapes as one token sequence (a pack), for a model's ``forward_packed``.

    Attributes:
        indices: int64 [n] sample indices, in pack order (samples of one shape adjacent).
        tokens: [sum S_i, C*pt*ph*pw] clean latents, patchified (:func:`~adaptiveload.models.packed.patchify_packed`).
        noise: [sum S_i, C*pt*ph*pw] ε, patchified the same way.
        context: [n, L, text_dim] (zero-padded to one L); sigma: [n].
        grid: int64 [n, 3] tokens per axis of each sample (CPU).
        layout: the :class:`~adaptiveload.sched.packing.PackedBatch` (``cu_seqlens`` int32 [n + 1],
            ``segment_ids`` int32 [sum S_i], ``latent_shapes`` int64 [n, 3], ``max_seqlen``; CPU).
    """

    indices: Tensor
    tokens: Tensor
    noise: Tensor
    context: Tensor
    sigma: Tensor
    grid: Tensor
    layout: PackedBatch

    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def num_tokens(self) -> int:
        """Tokens of the pack, ``sum S_i``."""
        return int(self.tokens.shape[0])

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(T, H, W) of the pack's longest sample (what a failure message names)."""
        longest = int(torch.argmax(self.grid.prod(dim=1)))
        return tuple(int(v) for v in self.layout.latent_shapes[longest])

    def pin_memory(self) -> "PackBatch":
        """Page-locked copies of the tensors the step moves to the GPU."""
        return dataclasses.replace(self, tokens=self.tokens.pin_memory(), noise=self.noise.pin_memory(),
                                   context=self.context.pin_memory(), sigma=self.sigma.pin_memory())


def collate_pack(samples: Sequence[dict], patch_size: tuple, text_len: Optional[int] = None) -> PackBatch:
    """Put dataset items of any latent shapes into one :class:`PackBatch`: ordered by shape (so
    samples of one shape are adjacent: the attention groups them without copies), latents and noise
    patchified with ``patch_size``, text padded as in :func:`collate`.

    Raises:
        ValueError: an empty list, a shape not divisible by the patch (naming the sample), or a text
            embedding longer than ``text_len``.
    """
    if not samples:
        raise ValueError("collate_pack: empty pack")
    samples = sorted(samples, key=lambda item: tuple(item["latents"].shape))
    layout = collate_packed([{"index": item["index"], "latents": item["latents"]} for item in samples],
                            patch_size=patch_size)
    tokens, grid, _ = patchify_packed([item["latents"] for item in samples], patch_size)
    noise, _, _ = patchify_packed([item["noise"] for item in samples], patch_size)
    return PackBatch(torch.tensor([item["index"] for item in samples], dtype=torch.int64), tokens, noise,
                     _stack_text(samples, text_len, "collate_pack"), torch.stack([item["sigma"] for item in samples]),
                     grid, layout)


def synthetic_batch(
    spec: InputSpec, batch_size: int, latent_shape: tuple, seed: int = 0, device: torch.device | str = "cpu"
) -> Batch:
    """A random batch of ``batch_size`` samples of one latent shape (calibration, warm-up).

    Draws like :class:`LatentDataset` (on ``device``) with sample indices ``0..batch_size-1``.
    """
    shapes = np.tile(np.asarray(latent_shape, dtype=np.int64), (batch_size, 1))
    dataset = LatentDataset(shapes, spec, seed=seed, device=device)
    return collate([dataset[i] for i in range(batch_size)])


def synthetic_pack(spec: InputSpec, latent_shapes, seed: int = 0, device: torch.device | str = "cpu") -> PackBatch:
    """A random pack of samples of the given latent shapes ([n, 3]; warm-up), drawn like
    :func:`synthetic_batch` with sample indices ``0..n-1``."""
    dataset = LatentDataset(latent_shapes, spec, seed=seed, device=device)
    return collate_pack([dataset[i] for i in range(len(dataset))], spec.patch_size, spec.text_len)
