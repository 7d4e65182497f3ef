"""Dataset manifests: per-sample sizes read from CSV / JSONL / Parquet, and the reference mix.

A manifest lists one row per sample with pixel sizes ``num_frames,height,width`` (an image has
``num_frames = 1``), latent sizes ``latent_t,latent_h,latent_w`` (the VAE latent grid, before
patchify), or a token count ``seq_len``; other columns are ignored, so Open-Sora's CSV works as
written (``path,text,num_frames,height,width,aspect_ratio,resolution,fps`` with numbers such as
``330.0``). Latent columns win over pixel columns (they are the tensors' own shapes, whatever the
VAE stride), and pixel columns over ``seq_len``.

Sample files: the columns ``latent_path`` and ``text_path`` (both or neither) name each sample's
latent tensor and text embedding, relative to the manifest's folder (or absolute). They are only
recorded here (:attr:`Manifest.latent_paths`, :attr:`Manifest.text_paths`): reading a manifest
never opens them, so planning a corpus needs only its sizes.

Units (see :mod:`adaptiveload.sched.shapes`): pixel ``(frames, H_px, W_px)``; latent ``(T, H, W)``
= ``((frames-1)//4 + 1, H_px/8, W_px/8)`` for Wan 2.1 VAE strides, pixel sizes floored to a multiple
of 16 (the dataset resizes to the bucket); token ``S = T*(H/2)*(W/2)`` for a 1x2x2 patch.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from adaptiveload.sched.shapes import WAN_PATCH_SIZE, WAN_VAE_STRIDE, latent_shape, tokens_from_latent

PIXEL_COLUMNS = ("num_frames", "height", "width")
LATENT_COLUMNS = ("latent_t", "latent_h", "latent_w")
TOKEN_COLUMN = "seq_len"
FILE_COLUMNS = ("latent_path", "text_path")
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".parquet": "parquet"}

# The reference corpus: an image/video mix of the shares below (probabilities; see :func:`reference_mix`).
REFERENCE_IMAGE_SHARE = 0.30
REFERENCE_RESOLUTIONS = ((480, 832), (720, 1280))
REFERENCE_RESOLUTION_PROBS = (0.70, 0.30)
REFERENCE_FRAMES = (17, 33, 49, 65, 81)
REFERENCE_FRAME_PROBS = (0.10, 0.15, 0.20, 0.20, 0.35)


@dataclass
class Manifest:
    """Per-sample sizes of a dataset.

    Attributes:
        seq_lens: int64 [n], tokens per sample S.
        latent_shapes: int64 [n, 3] latent ``(T, H, W)`` before patchify -- the tensor shape the
            dataset must produce for each sample -- or ``None`` when the manifest gave only ``seq_len``.
        pixel_shapes: int64 [n, 3] ``(frames, H_px, W_px)`` as written in the manifest, or ``None``.
        vae_stride, patch_size: the conversion used (``vae_stride`` is unused when the manifest gave
            latent sizes).
        source: where the rows came from (a path or ``"reference_mix(...)"``).
        latent_paths, text_paths: object arrays [n] of each sample's latent / text-embedding file
            (``str``, resolved against the manifest's folder), or ``None`` when the manifest names no files.
    """

    seq_lens: np.ndarray
    latent_shapes: np.ndarray | None = None
    pixel_shapes: np.ndarray | None = None
    vae_stride: tuple = WAN_VAE_STRIDE
    patch_size: tuple = WAN_PATCH_SIZE
    source: str = ""
    latent_paths: np.ndarray | None = None
    text_paths: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])

    def head(self, n: int) -> "Manifest":
        """The first ``n`` samples (all of them when ``n >= len(self)``); ``source`` gains ``(first n rows)``.

        Raises:
            ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"the number of samples must be >= 1, got {n}")
        if n >= len(self):
            return self
        first = [None if a is None else a[:n] for a in (self.seq_lens, self.latent_shapes, self.pixel_shapes)]
        files = [None if a is None else a[:n] for a in (self.latent_paths, self.text_paths)]
        return Manifest(*first, self.vae_stride, self.patch_size, f"{self.source} (first {n:,} rows)", *files)

    @property
    def bucket_keys(self) -> np.ndarray:
        """Per-sample bucket key: the latent shapes [n, 3], or ``seq_lens[:, None]`` without shapes."""
        return self.latent_shapes if self.latent_shapes is not None else self.seq_lens[:, None]

    @classmethod
    def from_pixels(cls, num_frames, height, width, *, vae_stride=WAN_VAE_STRIDE, patch_size=WAN_PATCH_SIZE,
                    source: str = "") -> "Manifest":
        """Build from pixel sizes (int arrays [n]); pixel sizes are floored to whole patches.

        Example::

            >>> m = Manifest.from_pixels([1, 81, 81], [480, 480, 720], [832, 832, 1280])
            >>> m.seq_lens.tolist(), m.latent_shapes[1].tolist(), len(m.head(2))
            ([1560, 32760, 75600], [21, 60, 104], 2)
        """
        pixels = np.stack([np.asarray(v, dtype=np.int64).reshape(-1) for v in (num_frames, height, width)], axis=1)
        shapes = latent_shape(pixels[:, 0], pixels[:, 1], pixels[:, 2], vae_stride=vae_stride, patch_size=patch_size)
        return cls(tokens_from_latent(shapes, patch_size=patch_size), shapes, pixels, tuple(vae_stride),
                   tuple(patch_size), source)

    @classmethod
    def from_latents(cls, latent_t, latent_h, latent_w, *, patch_size=WAN_PATCH_SIZE, source: str = "") -> "Manifest":
        """Build from latent sizes (int arrays [n]: the VAE latent grid ``(T, H, W)`` of each sample).

        Raises:
            ValueError: a size that is not a positive multiple of the patch (named with its index).

        Example::

            >>> m = Manifest.from_latents([11, 1], [15, 22], [26, 40], patch_size=(1, 1, 1))
            >>> m.seq_lens.tolist(), m.pixel_shapes is None
            ([4290, 880], True)
        """
        shapes = np.stack([np.asarray(v, dtype=np.int64).reshape(-1) for v in (latent_t, latent_h, latent_w)], axis=1)
        bad = _off_patch(shapes, patch_size)
        if bad is not None:
            i, j = bad
            raise ValueError(f"{LATENT_COLUMNS[j]} {int(shapes[i, j])} at index {i} is not a positive multiple of "
                             f"the patch size {patch_size[j]} (patch {tuple(patch_size)})")
        return cls(tokens_from_latent(shapes, patch_size=patch_size), shapes, None, patch_size=tuple(patch_size),
                   source=source)

    @classmethod
    def from_seq_lens(cls, seq_lens, *, source: str = "") -> "Manifest":
        """Build from token counts (int array [n]); every S is its own bucket."""
        s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if np.any(s < 1):
            raise ValueError(f"seq_len must be >= 1, got {int(s[np.argmax(s < 1)])} at index {int(np.argmax(s < 1))}")
        return cls(s, source=source)


# ----------------------------------------------------------------------------------------- reading


def _format_of(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: unknown manifest format {ext!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[ext]


def _size_columns(path: str, columns: Sequence[str]) -> tuple[str, ...]:
    """The size columns to read (module docstring), then the file columns when there are any."""
    files = [c for c in FILE_COLUMNS if c in columns]
    if len(files) == 1:
        (missing,) = set(FILE_COLUMNS) - set(files)
        raise ValueError(f"{path}: has a {files[0]} column but no {missing} column: give both, or neither")
    for names in (LATENT_COLUMNS, PIXEL_COLUMNS):
        if all(c in columns for c in names):
            return names + tuple(files)
    if TOKEN_COLUMN in columns and not files:
        return (TOKEN_COLUMN,)
    expected = f"{','.join(PIXEL_COLUMNS)} or {','.join(LATENT_COLUMNS)}"
    if not files:
        expected += f" or {TOKEN_COLUMN}"
    else:  # a file's tensor needs a shape to check it against
        expected += f" (sample files need the shape; {TOKEN_COLUMN} alone gives none)"
    raise ValueError(f"{path}: no size columns: expected {expected}; found {','.join(columns) or 'none'}")


def _off_patch(shapes: np.ndarray, patch_size) -> tuple[int, int] | None:
    """(sample, dim) of the first latent size [n, 3] that is not a positive multiple of the patch, or None."""
    bad = np.argwhere((shapes < np.asarray(patch_size)) | (shapes % np.asarray(patch_size) != 0))
    return (int(bad[0][0]), int(bad[0][1])) if bad.size else None


def _paths(path: str, name: str, raw: list, lines: list[int] | None) -> np.ndarray:
    """One file column as an object array of paths, resolved against the manifest's folder; a missing
    (empty) value raises naming its row."""
    folder = os.path.dirname(os.path.abspath(path))
    out = np.empty(len(raw), dtype=object)
    for i, v in enumerate(raw):
        if v is None or not str(v).strip():
            where = f"{path}: row {i + 1}" + (f" (line {lines[i]})" if lines else "")
            raise ValueError(f"{where}: field '{name}' is missing")
        out[i] = os.path.join(folder, str(v).strip())
    return out


def _to_positive_ints(path: str, name: str, raw: list, lines: list[int] | None) -> np.ndarray:
    """Convert one column of raw values (str / number / None) to int64, naming the first bad row."""
    try:
        values = np.array(raw, dtype=np.float64)
        ok = np.isfinite(values) & (values > 0) & (values == np.floor(values))
    except (TypeError, ValueError):
        values, ok = None, None
    if ok is not None and ok.all():
        return values.astype(np.int64)
    for i, v in enumerate(raw):
        where = f"{path}: row {i + 1}" + (f" (line {lines[i]})" if lines else "")
        if v is None or (isinstance(v, str) and not v.strip()):
            raise ValueError(f"{where}: field '{name}' is missing")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: field '{name}' = {v!r} is not a number") from None
        if not np.isfinite(x) or x <= 0:
            raise ValueError(f"{where}: field '{name}' = {v!r} must be positive")
        if x != np.floor(x):
            raise ValueError(f"{where}: field '{name}' = {v!r} is not an integer")
    raise AssertionError("unreachable: a bad value was detected but not located")  # pragma: no cover


def _read_csv(path: str):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (no header)")
        header = [h.strip() for h in header]
        names = _size_columns(path, header)
        idx = [header.index(n) for n in names]
        raw = {n: [] for n in names}
        lines = []
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            for n, j in zip(names, idx):
                raw[n].append(row[j] if j < len(row) else None)
            lines.append(reader.line_num)
    return raw, lines


def _read_jsonl(path: str):
    raw, lines, names = None, [], None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {line_no}: invalid JSON: {err.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object, got {type(obj).__name__}")
            if names is None:
                names = _size_columns(path, list(obj))
                raw = {n: [] for n in names}
            for n in names:
                raw[n].append(obj.get(n))
            lines.append(line_no)
    if names is None:
        raise ValueError(f"{path}: empty file (no rows)")
    return raw, lines


def _read_parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is installed in CI
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install adaptiveload[parquet])") from None
    schema_names = pq.read_schema(path).names
    names = _size_columns(path, schema_names)
    table = pq.read_table(path, columns=list(names))
    return {n: table.column(n).to_pylist() if table.column(n).null_count else table.column(n).to_numpy() for n in names}, None


def load_manifest(path: str, *, vae_stride=WAN_VAE_STRIDE, patch_size=WAN_PATCH_SIZE) -> Manifest:
    """Read a manifest file (format from the extension: ``.csv``, ``.jsonl``, ``.parquet``).

    Args:
        path: the file. Columns ``num_frames,height,width`` (pixels), ``latent_t,latent_h,latent_w``
            (latent grid) or ``seq_len`` (tokens), and optionally ``latent_path,text_path`` (sample
            files; not opened); other columns are ignored. Integral floats (``330.0``) are accepted.
        vae_stride, patch_size: pixel -> latent -> token conversion (Wan 2.1 defaults 4x8x8, 1x2x2).

    Returns:
        A :class:`Manifest` (``latent_shapes`` is ``None`` for a ``seq_len``-only file).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown extension, no size columns, one file column without the other, file
            columns with ``seq_len`` alone, no rows, or a bad value -- naming the file, the row (1-based
            data row, header excluded; plus the line for CSV/JSONL) and the field: missing, not a
            number, not positive, not an integer, a pixel size below one patch, or a latent size that
            is not a multiple of the patch.
    """
    path = os.fspath(path)
    fmt = _format_of(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"manifest not found: {path}")
    raw, lines = {"csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}[fmt](path)
    n = len(next(iter(raw.values())))
    if n == 0:
        raise ValueError(f"{path}: no rows")
    files = {name: _paths(path, name, list(raw.pop(name)), lines) for name in FILE_COLUMNS if name in raw}
    cols = {name: _to_positive_ints(path, name, list(v) if not isinstance(v, np.ndarray) else v, lines)
            for name, v in raw.items()}
    if TOKEN_COLUMN in cols:
        return Manifest.from_seq_lens(cols[TOKEN_COLUMN], source=path)
    paths = {"latent_paths": files.get("latent_path"), "text_paths": files.get("text_path")}
    if LATENT_COLUMNS[0] in cols:
        bad = _off_patch(np.stack([cols[n] for n in LATENT_COLUMNS], axis=1), patch_size)
        if bad is not None:
            i, j = bad
            where = f"row {i + 1}" + (f" (line {lines[i]})" if lines else "")
            raise ValueError(f"{path}: {where}: field '{LATENT_COLUMNS[j]}' = {int(cols[LATENT_COLUMNS[j]][i])} is "
                             f"not a multiple of the patch size {patch_size[j]} (patch {tuple(patch_size)})")
        latents = Manifest.from_latents(*(cols[n] for n in LATENT_COLUMNS), patch_size=patch_size, source=path)
        return dataclasses.replace(latents, vae_stride=tuple(vae_stride), **paths)
    for name, stride, patch in (("height", vae_stride[1], patch_size[1]), ("width", vae_stride[2], patch_size[2])):
        bad = np.flatnonzero(cols[name] < stride * patch)
        if bad.size:
            i = int(bad[0])
            where = f"row {i + 1}" + (f" (line {lines[i]})" if lines else "")
            raise ValueError(f"{path}: {where}: field '{name}' = {int(cols[name][i])} is below one patch "
                             f"({stride * patch} px = VAE stride {stride} x patch {patch})")
    pixels = Manifest.from_pixels(cols["num_frames"], cols["height"], cols["width"], vae_stride=vae_stride,
                                  patch_size=patch_size, source=path)
    return dataclasses.replace(pixels, **paths)


def write_manifest(manifest: Manifest, path: str) -> None:
    """Write ``manifest`` as CSV / JSONL / Parquet (by extension): pixel columns when known, else
    latent columns when known, else ``seq_len``; then the sample files' columns when it has them
    (as stored: resolved paths).

    Raises:
        ValueError: unknown extension (or Parquet without pyarrow).
    """
    path = os.fspath(path)
    fmt = _format_of(path)
    if manifest.pixel_shapes is not None:
        names, data = PIXEL_COLUMNS, manifest.pixel_shapes
    elif manifest.latent_shapes is not None:
        names, data = LATENT_COLUMNS, manifest.latent_shapes
    else:
        names, data = (TOKEN_COLUMN,), manifest.seq_lens[:, None]
    columns = {n: data[:, j].tolist() for j, n in enumerate(names)}
    if manifest.latent_paths is not None:
        columns.update(latent_path=manifest.latent_paths.tolist(), text_path=manifest.text_paths.tolist())
    rows = zip(*columns.values())
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(columns)
            writer.writerows(rows)
    elif fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(zip(columns, row))) + "\n")
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover
            raise ValueError(f"{path}: writing Parquet needs pyarrow (pip install adaptiveload[parquet])") from None
        pq.write_table(pa.table(columns), path)


def reference_mix(num_samples: int, seed: int = 0, *, vae_stride=WAN_VAE_STRIDE, patch_size=WAN_PATCH_SIZE) -> Manifest:
    """The reference image/video mix, drawn at random.

    Each sample is independently an image (probability 0.30, ``num_frames = 1``) or a video (0.70)
    of 17/33/49/65/81 frames (probabilities 0.10/0.15/0.20/0.20/0.35); the resolution is 480x832
    (0.70) or 720x1280 (0.30). With the Wan 2.1 token formula this gives 12 buckets,
    S from 1,560 (a 480x832 image) to 75,600 (81 frames at 720x1280).

    Args:
        num_samples: rows to draw (>= 1).
        seed: seed of a local ``numpy.random.Generator`` (same seed, same manifest).

    Returns:
        A :class:`Manifest` with pixel, latent and token sizes.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    rng = np.random.default_rng(seed)
    is_video = rng.random(num_samples) >= REFERENCE_IMAGE_SHARE
    frames = np.where(is_video, rng.choice(REFERENCE_FRAMES, size=num_samples, p=REFERENCE_FRAME_PROBS), 1)
    res = np.asarray(REFERENCE_RESOLUTIONS)[rng.choice(len(REFERENCE_RESOLUTIONS), size=num_samples, p=REFERENCE_RESOLUTION_PROBS)]
    return Manifest.from_pixels(frames, res[:, 0], res[:, 1], vae_stride=vae_stride, patch_size=patch_size,
                                source=f"reference_mix(num_samples={num_samples}, seed={seed})")
