"""The ``adaptiveload`` torch.compile backend: fuse norm→modulate chains (every registered pattern), then compile.

    model = torch.compile(model, backend="adaptiveload")
    model = torch.compile(model, backend="adaptiveload", options={"inner": "aot_eager", "fuse": True})

The name comes from the ``torch_dynamo_backends`` entry point in ``pyproject.toml`` (nothing is
registered at import: Dynamo's registry asserts on duplicate names). torch.compile hands a string
backend's ``options`` dict to it as the keyword ``options=`` (and a non-default ``mode`` as
``mode=``), through ``torch._TorchCompileWrapper`` on torch 2.11-2.14; calling the backend directly
with the same keys as keyword arguments works too.

Options:
    fuse (bool, default True): run the rewrite. ``ADAPTIVELOAD_DISABLE`` set to 1/true/yes/on in the
        environment turns it off regardless (0/false/no/off or empty: on; any other value raises a
        ValueError at compile time).
    inner (str, default "inductor"): the compiler the (rewritten) graph goes to: "inductor"
        (``torch._inductor.compile_fx.compile_fx``), "aot_eager" (AOTAutograd, no code generation;
        the debugging reference) or "eager" (run the FX graph as is).
    any other key: an Inductor config patch (only with inner="inductor"), as ``torch.compile``
        passes options to Inductor.

The rewrite runs on a copy of the graph; if it raises, the backend warns once and compiles the
original graph, so a half-rewritten graph never reaches the inner compiler. With inner="inductor"
the backend also hands Inductor a post-grad pass (:mod:`adaptiveload.fxfuse.grad_adds`, chained in
front of any ``post_grad_custom_post_pass`` already configured) that folds the add of another
gradient to a norm-site backward op's dx into the op.

What each compile fused: :func:`collect_reports` gathers the :class:`FusionReport` of every backend
call made inside a ``with`` block, and ``torch._dynamo.utils.counters["adaptiveload"]`` counts
"graphs" (graphs the rewrite ran on); "seen" (chains a pattern matched), "fused" (chains rewritten
into an op), "skipped" (matched but left alone, each with a reason in the report) and "deferred"
(matched by a pattern that hands its rejects to the next one, e.g. the residual norm site to the
plain one), in total and per pattern as "<pattern>.seen" etc. (:mod:`adaptiveload.fxfuse.registry`);
"pass_failures"; and "dx_addends", the adds folded into backward ops by the post-grad pass, counted
when Inductor compiles a graph: a graph served from Inductor's FX graph cache (on by default, on
disk across processes) runs no pass and adds nothing, though its code has the folds.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _LazyGraphModule

from adaptiveload.fxfuse.report import FusionReport
from adaptiveload.fxfuse.rewrite import fuse_adaln
from adaptiveload.ops.common import setting

logger = logging.getLogger("adaptiveload.fxfuse")

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
DISABLE_ENV = "ADAPTIVELOAD_DISABLE"

_DISABLE_VALUES = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True,
                   "off": False, "on": True, "": False}

# the sinks of the enclosing collect_reports() blocks, innermost last (per thread and async task)
_sinks: contextvars.ContextVar[tuple[list[FusionReport], ...]] = contextvars.ContextVar(
    "adaptiveload_report_sinks", default=())
_warned = False


@contextlib.contextmanager
def collect_reports() -> Iterator[list[FusionReport]]:
    """Collect what the backend fused while the ``with`` block runs.

        with collect_reports() as reports:
            loss = compiled(x).sum()   # the first call compiles: the backend runs
        fused = sum(r.fused for r in reports)

    Yields:
        A list to which every adaptiveload backend call made inside the block (in this thread or
        async task) appends its :class:`FusionReport`, in call order: one report per rewritten graph
        (a recompile, e.g. for a new input shape, adds one; a graph break gives two). Calls that did
        not run the rewrite (``fuse=False``, ``ADAPTIVELOAD_DISABLE``, a failed pass) add nothing.
        Blocks nest: a call is appended to the list of every enclosing block. The list stays valid
        after the block.
    """
    sink: list[FusionReport] = []
    token = _sinks.set((*_sinks.get(), sink))
    try:
        yield sink
    finally:
        _sinks.reset(token)


def fusion_disabled() -> bool:
    """Whether ``ADAPTIVELOAD_DISABLE`` turns the rewrite off: True for 1/true/yes/on, False for
    0/false/no/off, empty or unset (case-insensitive, surrounding spaces ignored).

    Raises:
        ValueError: any other value (the message names the variable and the value).
    """
    return _DISABLE_VALUES[setting(DISABLE_ENV, "", tuple(_DISABLE_VALUES))]


def adaptiveload_backend(
    gm: GraphModule,
    example_inputs: list[Any],
    *,
    options: Optional[dict[str, Any]] = None,
    mode: Optional[str] = None,
    **kwargs: Any,
) -> Callable:
    """A torch.compile backend: rewrite the chains of ``gm`` that the registered patterns match (norm→modulate), then compile it.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: ``{"fuse": bool, "inner": "inductor" | "aot_eager" | "eager", <Inductor config>...}``
            (what ``torch.compile(..., options=...)`` passes).
        mode: torch.compile's ``mode`` ("max-autotune", ...), forwarded to Inductor.
        **kwargs: the same keys as ``options``, for a direct call.

    Returns:
        The compiled callable of the inner compiler.

    Raises:
        ValueError: an unknown inner compiler, a non-bool ``fuse``, Inductor config keys or a
            ``mode`` with a non-Inductor inner compiler, or an ``ADAPTIVELOAD_DISABLE`` value that
            is not one of :func:`fusion_disabled`'s.
    """
    fuse, inner, inductor_config = _parse_options({**(options or {}), **kwargs})
    if mode is not None and inner != "inductor":
        raise ValueError(f"adaptiveload backend: mode={mode!r} is an Inductor setting, but inner={inner!r}")
    disabled = fusion_disabled()
    graph = gm
    if not fuse:
        logger.info("norm→modulate fusion is off (option fuse=False): compiling the graph unchanged")
    elif disabled:
        logger.info("norm→modulate fusion is off (%s is set): compiling the graph unchanged", DISABLE_ENV)
    else:
        graph = _fused_copy(gm)
        if inner == "inductor":  # the adds after the norm-site backward ops, folded into them
            from adaptiveload.fxfuse.grad_adds import FoldDxAddends

            key = "post_grad_custom_post_pass"
            inductor_config = {**inductor_config, key: FoldDxAddends(inductor_config.get(key, _inductor_setting(key)))}
    return _compile_inner(inner, graph, example_inputs, mode, inductor_config)


def _inductor_setting(key: str) -> Any:
    import torch._inductor.config

    return getattr(torch._inductor.config, key)


def _parse_options(options: dict[str, Any]) -> tuple[bool, str, dict[str, Any]]:
    options = dict(options)
    fuse = options.pop("fuse", True)
    inner = options.pop("inner", "inductor")
    if not isinstance(fuse, bool):
        raise ValueError(f"adaptiveload backend: option 'fuse' must be True or False, got {fuse!r}")
    if inner not in INNER_COMPILERS:
        raise ValueError(f"adaptiveload backend: option 'inner' must be one of {INNER_COMPILERS}, got {inner!r}")
    if options and inner != "inductor":
        raise ValueError(
            f"adaptiveload backend: unknown options {sorted(options)} (known: 'fuse', 'inner'; other keys are "
            f"Inductor config patches and need inner='inductor')"
        )
    return fuse, inner, options


def _fused_copy(gm: GraphModule) -> GraphModule:
    """The rewritten copy of ``gm``, or ``gm`` itself if the pass raised (warned once)."""
    global _warned
    try:
        work = copy_graph_module(gm)
        report = fuse_adaln(work)
    except Exception as err:  # the pass must never break compilation: fall back to the original graph
        torch._dynamo.utils.counters["adaptiveload"]["pass_failures"] += 1
        message = f"adaptiveload: the fusion pass failed ({type(err).__name__}: {err}); compiling the unfused graph"
        if not _warned:
            _warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.debug(message, exc_info=True)
        return gm
    for sink in _sinks.get():
        sink.append(report)
    if report.seen:
        logger.info(report.summary())
    return work


def copy_graph_module(gm: GraphModule, _memo: Optional[dict] = None) -> GraphModule:
    """A copy of ``gm`` whose graph, and the graphs of its GraphModule children (higher-order-op
    bodies), can be rewritten without touching ``gm``'s. Parameters, buffers and node metadata
    (fake values) are shared, not copied; ``gm.meta`` and the attributes Dynamo sets on the module and
    on its placeholders are carried over."""
    memo = {} if _memo is None else _memo
    if id(gm) in memo:
        return memo[id(gm)]
    graph = copy.deepcopy(gm.graph)  # new nodes, shallow copies of their meta
    for old_node, new_node in zip(gm.graph.nodes, graph.nodes):
        new_node.__dict__.update(old_node.__dict__)  # e.g. Dynamo's _dynamo_source on placeholders
    # a _LazyGraphModule (what Dynamo hands a backend) generates its Python code on first call:
    # neither the copy nor the rewrite's recompile() pays for code the inner compiler never runs
    new = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    memo[id(gm)] = new
    new.meta = dict(getattr(gm, "meta", {}))
    for key, value in gm.__dict__.items():  # e.g. Dynamo's _param_name_to_source
        new.__dict__.setdefault(key, value)
    for name, child in gm.named_children():
        if isinstance(child, GraphModule) and hasattr(new, name):
            setattr(new, name, copy_graph_module(child, memo))
    return new


def _compile_inner(inner: str, gm: GraphModule, example_inputs: list[Any], mode: Optional[str],
                   inductor_config: dict[str, Any]) -> Callable:
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    config = {**(list_mode_options(mode) if mode else {}), **inductor_config}
    return compile_fx(gm, example_inputs, config_patches=config or None)
