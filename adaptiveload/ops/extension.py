"""Build, cache and load the CUDA kernels in ``csrc/`` (JIT, on first CUDA use).

The sources ship with the package (``adaptiveload/_csrc`` in a wheel, see :func:`source_dir`); nothing
is compiled at install time. Every ``.cu`` file under the source folder, subfolders included, is
compiled with :func:`torch.utils.cpp_extension.load` (ninja), the folder itself on the include path,
into a cache folder keyed by torch version, CUDA version, GPU architecture and a hash of every
source file (paths and contents) and of the compiler flags:

    $ADAPTIVELOAD_CACHE (default ~/.cache/adaptiveload) / torch<ver>-cu<ver>-sm<arch>-<hash>/

The architecture is the current device's (``sm_90`` on H100/H200) unless ``TORCH_CUDA_ARCH_LIST``
is set. Concurrent processes (every torchrun rank) serialize on an OS file lock (``fcntl.flock``)
in that folder: the first builds, the others wait and then load the finished module, and a killed
process releases the lock when it dies (unlike torch's own baton file, which is removed here when
found under the lock, since only a dead builder can have left it).

When the kernels cannot be built (no CUDA toolkit, a compiler error) :func:`kernels` logs and warns
once with the cause and returns None, and the op runs its PyTorch reference implementation;
``ADAPTIVELOAD_REQUIRE_KERNEL=1`` turns that into a ``RuntimeError``.

Loading the module registers the ops' CUDA and AutogradCUDA kernels with the dispatcher from C++
(``csrc/norm_modulate_dispatch.cu``), so that later CUDA calls run no Python. The call that builds
the module is served by the op's Python CUDA path (:data:`CUDA_PATHS`), which the ops'
CompositeExplicitAutograd kernels route CUDA tensors to until then; afterwards the C++ kernels hand
that path the calls they do not take (invalid inputs, for its ``ValueError``; float64, rows wider than
the kernels', mixed modulation dtypes, for its reference).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional

import torch

logger = logging.getLogger("adaptiveload.ops")

_MODULE_NAME = "adaptiveload_adaln_kernels"
# -O3 for the device code; the kernels use constexpr helpers from host and device code. No -std: the C++
# standard is torch's own (cpp_extension adds C++20 where this torch's headers ask for it; torch 2.14's
# ATen headers reject anything older, pytorch/pytorch#178150).
_NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

#: Each op's Python CUDA path by op name (validation, then the kernels or the reference), set by the op
#: modules on import; the loaded kernels get them (``register_dispatch``) for the calls they do not take.
CUDA_PATHS: dict[str, Callable] = {}

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_failure: Optional[str] = None  # cause of a failed build, remembered so it is tried (and warned) once


def source_dir() -> Path:
    """Folder holding the kernel sources: ``.cu`` files and their headers, in it or its subfolders.

    In an installed wheel they ship inside the package as ``adaptiveload/_csrc``; in a source
    checkout or an editable install they are ``<repo>/csrc``.

    Raises:
        FileNotFoundError: neither folder holds a ``.cu`` file at any depth.
    """
    here = Path(__file__).resolve().parent.parent  # .../adaptiveload
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if any(candidate.rglob("*.cu")):
            return candidate
    raise FileNotFoundError(f"no CUDA sources in {here / '_csrc'} or {here.parent / 'csrc'} (nor their subfolders)")


def source_files(src: Path) -> list[Path]:
    """Every file under the source folder ``src`` (subfolders included, hidden files and folders
    left out), sorted by path: what the wheel ships and what the cache key hashes."""
    return sorted(p for p in src.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(src).parts))


def cuda_sources(src: Path) -> list[Path]:
    """The ``.cu`` files under ``src`` (subfolders included): the translation units of the build.

    Raises:
        RuntimeError: two of them share a file name (their objects would overwrite each other in
            the build folder); the message names both.
    """
    units = [p for p in source_files(src) if p.suffix == ".cu"]
    seen: dict[str, Path] = {}
    for path in units:
        if path.name in seen:
            raise RuntimeError(f"kernel sources {seen[path.name].relative_to(src)} and {path.relative_to(src)} "
                               f"share the file name {path.name!r}; the build needs unique names")
        seen[path.name] = path
    return units


def arch_list() -> str:
    """The architectures to build for: ``TORCH_CUDA_ARCH_LIST`` if set, else the current device's
    compute capability (e.g. ``"9.0"``).

    Raises:
        RuntimeError: neither is available (no visible CUDA device and no ``TORCH_CUDA_ARCH_LIST``).
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible and TORCH_CUDA_ARCH_LIST is not set")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def cache_dir() -> Path:
    """The build folder for this torch, CUDA, architecture and source tree (see the module doc)."""
    base = Path(os.environ.get("ADAPTIVELOAD_CACHE") or Path.home() / ".cache" / "adaptiveload")
    digest = hashlib.sha256()
    src = source_dir()
    for path in source_files(src):
        for part in (path.relative_to(src).as_posix().encode(), path.read_bytes()):
            digest.update(len(part).to_bytes(8, "little") + part)
    digest.update(" ".join(_NVCC_FLAGS).encode())
    arch = "".join(c if c.isalnum() else "_" for c in arch_list().replace(".", ""))
    key = f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch}-{digest.hexdigest()[:12]}"
    return base / key.replace("+", "_")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive OS lock on ``path``, released on exit or when the process dies."""
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build(verbose: bool = False) -> ModuleType:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(f"this torch ({torch.__version__}) was built without CUDA")
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("nvcc not found (CUDA_HOME is not set and nvcc is not on PATH)")
    src = source_dir()
    units = cuda_sources(src)
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    arch = arch_list()
    with _file_lock(out / "adaptiveload.lock"):
        stale = out / "lock"  # torch's baton: under our lock, only a killed builder can have left it
        if stale.exists():
            logger.warning("removing a stale build baton left by a killed process: %s", stale)
            stale.unlink()
        previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        try:
            logger.info("building the adaptiveload CUDA kernels for %s in %s", arch, out)
            return cpp_extension.load(
                name=_MODULE_NAME,
                sources=[str(p) for p in units],
                extra_include_paths=[str(src)],
                extra_cuda_cflags=_NVCC_FLAGS,
                build_directory=str(out),
                verbose=verbose,
            )
        finally:
            if previous is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = previous


def _load(verbose: bool = False) -> ModuleType:
    """The built module, its dispatcher kernels handed the ops' Python CUDA paths."""
    module = _build(verbose=verbose)
    module.register_dispatch(CUDA_PATHS)
    return module


def _require() -> bool:
    return os.environ.get("ADAPTIVELOAD_REQUIRE_KERNEL", "") not in ("", "0")


def kernels() -> Optional[ModuleType]:
    """The compiled kernel module, building it on first call; None when it cannot be built.

    On failure, warns once with the cause (and the op uses its reference implementation).

    Raises:
        RuntimeError: the build failed and ``ADAPTIVELOAD_REQUIRE_KERNEL=1`` is set.
    """
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _load()
            except Exception as err:  # noqa: BLE001 - any build failure means "use the reference"
                _failure = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
                if not _require():
                    logger.warning("CUDA kernels unavailable (%s); using the PyTorch reference path", _failure)
                    warnings.warn(
                        f"adaptiveload: CUDA kernels unavailable ({_failure}); the fused op runs its PyTorch "
                        "reference implementation (set ADAPTIVELOAD_REQUIRE_KERNEL=1 to make this an error)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    if _module is None and _require():
        raise RuntimeError(f"adaptiveload: CUDA kernels required (ADAPTIVELOAD_REQUIRE_KERNEL=1) but unavailable: {_failure}")
    return _module


def build(verbose: bool = False) -> Path:
    """Build (or load from cache) the kernels now and return the cache folder.

    For clusters: run once before launching many ranks, which then only load the cached module.

    Raises:
        RuntimeError: no CUDA (torch without CUDA, no device and no ``TORCH_CUDA_ARCH_LIST``,
            no nvcc), two kernel sources with one file name, or a compile error (its log is
            printed when ``verbose``).
    """
    global _module, _failure
    with _lock:
        if _module is None:
            _module = _load(verbose=verbose)
            _failure = None
    return cache_dir()
