"""Private: force the CUDA kernels' choices, for benchmarks and tests; users never need it.

The kernels choose every launch setting themselves, from the shape, the dtypes, the modulation layout
and the device (``csrc/norm_modulate.cu``: ``Tuning``; the rules in ``docs/kernels.md``), and read
nothing per call from Python or the environment. :func:`override` forces some of them for a block of
code, to time one choice against another or to test a path the heuristic would not take on that
shape::

    from adaptiveload.ops import _tuning

    with _tuning.override(fwd_stages=0, max_threads=512):  # the register forward, 512-thread rows
        torch.ops.adaptiveload.adaln_modulate(x, None, None, scale, shift, 1e-6, torch.bfloat16)

The override is process-wide: it holds for every thread and every CUDA call of the ops, a call from
a compiled graph included (the graph calls the op, whose kernels read it at launch), but a CUDA graph
replays the launches it captured with the choices in force at capture. Overrides nest; each exit
restores what was in force on entry, also when the block raises. Not for concurrent use from several
threads.

It also warns once, at import, about the environment variables that used to set these choices
(:data:`REMOVED_VARIABLES`): they are ignored.
"""
from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Union

import torch

from adaptiveload.ops import extension


class Choices(NamedTuple):
    """The kernel choices in force; ``"auto"``: the kernels' own.

    Attributes:
        max_threads: threads-per-block cap of the row kernels, 32..512 (fewer threads, more 16-byte
            chunks a thread). Automatic, the residual ops' backward takes up to 640 threads of one
            chunk for rows of 513-640 groups of 8 elements (D = 5120); any cap keeps it to the cap.
        fwd_stages, bwd_stages: rows in the forward's / the backward row kernel's shared-memory ring
            on sm_90, 0 (the register prefetch of one row) or 2..8; where the ring cannot run
            (unaligned rows, rows too wide a thread, GPUs before sm_90, too little shared memory) the
            kernels take the register path whatever is asked. The residual ops' kernels read them
            as the slots of their per-thread staging ring (sm_80+; 0: rows loaded at use), which
            runs where every row tensor has r's dtype and the rows are aligned.
        store: how the ring forward writes y, ``"threads"`` (each thread its 16-byte groups) or
            ``"bulk"`` (into the row's ring slot, then one bulk store by the copy engine; only with
            per-sample or shared modulation, y of x's element size and 3+ slots, else as threads).
        tail: ``(P, R)``: P percent (0..50) of each sample's rows left to short blocks of R
            (1..65536) consecutive rows launched after the forward's wave.
        two_kernel: True: the backward's two-kernel design (dx, then the column sums re-reading x
            and dy) everywhere; False: the kernels' choice (one pass, two kernels for per-sample or
            shared rows over 16 elements a thread).
    """

    max_threads: Union[str, int] = "auto"
    fwd_stages: Union[str, int] = "auto"
    bwd_stages: Union[str, int] = "auto"
    store: str = "auto"
    tail: Union[str, tuple] = "auto"
    two_kernel: bool = False


AUTO = Choices()
# The environment variables that set these choices before they became the kernels' own.
REMOVED_VARIABLES = ("ADAPTIVELOAD_MAX_THREADS", "ADAPTIVELOAD_FWD_STAGES", "ADAPTIVELOAD_BWD_STAGES",
                     "ADAPTIVELOAD_FWD_ROW_ORDER", "ADAPTIVELOAD_FWD_STORE", "ADAPTIVELOAD_FWD_TAIL",
                     "ADAPTIVELOAD_BWD")
_TAIL_ROWS = 8  # rows of a short block when ``tail`` gives a percent only (the kernels' own)
_STORES = {"auto": -1, "threads": 0, "bulk": 1}

_lock = threading.Lock()
_current = AUTO


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(name: str, value):
    """``value`` of setting ``name`` in :class:`Choices`' form; ``ValueError`` naming the setting
    and the values it takes otherwise."""
    def bad(expected: str):
        return ValueError(f"override: {name}={value!r}: expected {expected}")

    if name == "two_kernel":
        if not isinstance(value, bool):
            raise bad("True or False")
        return value
    if isinstance(value, str) and value == "auto":
        return value
    if name == "max_threads":
        if not (_is_int(value) and 32 <= value <= 512):
            raise bad("'auto' or an integer 32..512")
    elif name in ("fwd_stages", "bwd_stages"):
        if not (_is_int(value) and (value == 0 or 2 <= value <= 8)):
            raise bad("'auto', 0 or an integer 2..8")
    elif name == "store":
        if value not in ("threads", "bulk"):
            raise bad("'auto', 'threads' or 'bulk'")
    elif name == "tail":
        pct, rows = value if isinstance(value, tuple) and len(value) == 2 else (value, _TAIL_ROWS)
        if not (_is_int(pct) and 0 <= pct <= 50 and _is_int(rows) and 1 <= rows <= 65536):
            raise bad("'auto', a percent P (0..50) or (P, R) with R rows a block (1..65536)")
        return pct, rows
    return value


def _native(c: Choices) -> tuple:
    """``c`` as the kernel module's ``set_tuning`` arguments (-1 / 0: automatic)."""
    tail = (-1, _TAIL_ROWS) if c.tail == "auto" else c.tail
    return (0 if c.max_threads == "auto" else c.max_threads, -1 if c.fwd_stages == "auto" else c.fwd_stages,
            -1 if c.bwd_stages == "auto" else c.bwd_stages, _STORES[c.store], *tail, c.two_kernel)


def _kernels():
    """The kernel module where the kernels can run (a CUDA device), built or loaded now; else None,
    and nothing to force."""
    return extension.kernels() if torch.cuda.is_available() else None


def _apply(c: Choices) -> None:
    global _current
    with _lock:
        _current = c
        module = _kernels()
        if module is not None:
            problem = module.set_tuning(*_native(c))
            if problem:  # the module's own check (values this module's checks let through)
                raise ValueError(problem)


def current() -> Choices:
    """The choices in force (:data:`AUTO` outside any override)."""
    return _current


@contextmanager
def override(
    *,
    max_threads: Optional[Union[str, int]] = None,
    fwd_stages: Optional[Union[str, int]] = None,
    bwd_stages: Optional[Union[str, int]] = None,
    store: Optional[str] = None,
    tail: Optional[Union[str, int, tuple]] = None,
    two_kernel: Optional[bool] = None,
) -> Iterator[Choices]:
    """Force the given kernel choices inside the block (see :class:`Choices` for each); a setting
    left None stays as it is outside the block, ``"auto"`` gives it back to the kernels.

    Yields:
        The :class:`Choices` in force inside the block.

    Raises:
        ValueError: a value a setting does not take (the message names the setting), before
            anything changes.
        RuntimeError: the kernels cannot be built and ``ADAPTIVELOAD_REQUIRE_KERNEL=1`` is set.
    """
    given = {"max_threads": max_threads, "fwd_stages": fwd_stages, "bwd_stages": bwd_stages, "store": store,
             "tail": tail, "two_kernel": two_kernel}
    previous = _current
    chosen = previous._replace(**{name: _checked(name, v) for name, v in given.items() if v is not None})
    try:
        _apply(chosen)
        yield chosen
    finally:
        _apply(previous)


def warn_removed_variables(environ=os.environ) -> list[str]:
    """Warn (one ``UserWarning``) when any of :data:`REMOVED_VARIABLES` is set in ``environ``: they
    are ignored. Called once, when ``adaptiveload`` is imported.

    Returns:
        The names of those that are set, in :data:`REMOVED_VARIABLES`' order.
    """
    found = [name for name in REMOVED_VARIABLES if name in environ]
    if found:
        warnings.warn(
            f"adaptiveload: {', '.join(found)} {'is' if len(found) == 1 else 'are'} set but ignored: the kernels "
            "choose their block shape, ring slots, row order, how y is stored, the short blocks after the wave "
            "and the backward's design themselves (these variables were removed)",
            UserWarning,
            stacklevel=2,
        )
    return found
