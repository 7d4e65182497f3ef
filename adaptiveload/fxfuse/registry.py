"""The patterns the fusion pass applies: each one a name and three functions, match / check / replace.

    from adaptiveload.fxfuse import Match, register_pattern

    register_pattern("my_op", match=my_match, check=my_check, replace=my_replace)

The pass (:func:`adaptiveload.fxfuse.fuse_adaln`) visits every node of every graph; on each it tries
the registered patterns in order -- the built-in ones first, in the order of ``BUILTIN_MODULES``
whichever of their modules was imported first, then the others in registration order -- and the
first whose ``match`` returns a non-empty :class:`Match` claims the node -- unless the pattern was
registered with ``falls_through=True`` and rejects the match (its reason, or a candidate's check):
then the node goes on to the next patterns, and the rejection is recorded in the report's
``deferred`` list (a more specific pattern ahead of a general one, e.g. the residual norm site ahead
of the plain norm→modulate site). Every match of a graph is checked before the first mutation; then
each accepted candidate is replaced. A pattern's functions:

``match(gm, node) -> Optional[Match]``
    Structure only, no mutation. Each candidate of the match must have the attributes
    ``anchor`` (the node the pattern starts from, e.g. the norm call: its name goes into the
    report), ``final`` (the node whose value the fused op replaces: its source line goes into the
    report), ``norm`` (str: how the anchor was written, e.g. "F.rms_norm"), ``affine`` (bool) and
    ``variant`` (str: the form matched, e.g. "norm*(1+scale)+shift"); optionally ``nodes``, the
    nodes its replacement rewrites: a candidate whose ``nodes`` meet those of a candidate accepted
    before it in the graph is rejected ("overlaps ..."), so no node is rewritten twice.
``check(candidate, cache) -> verdict``
    Decides, before anything is mutated, whether the candidate may be replaced; the verdict has
    ``reason`` (None: fuse it; else why it is left alone) and ``layout`` (str, for the report).
    ``cache`` is a dict kept for one run of the pass (e.g. for fake-kernel results).
``replace(gm, candidate, verdict, replaced) -> Node``
    Rewrites ``gm``'s graph: ``candidate.final``'s uses go to the fused op's output, and the nodes
    that this orphaned are erased; returns the new node. ``replaced`` maps the final nodes already
    replaced in this graph to their replacements (a candidate's input may be an earlier one's final
    node); ``replace`` adds its own. The op it calls is one ``torch.ops`` op whose backward (if any)
    is an op named ``<op>_backward``.

The candidates of one match are fused together or not at all (they share the anchor's output): the
match's own ``reason`` rejects all of them, and a candidate that fails its check rejects the others
with "shares its norm with a chain that is not fused (<its reason>)".

Counters: the pass adds its totals to ``torch._dynamo.utils.counters["adaptiveload"]`` under "seen",
"fused", "skipped" and "deferred", and each pattern's under "<name>.seen", "<name>.fused",
"<name>.skipped", "<name>.deferred".
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch.fx import GraphModule, Node

#: The built-in patterns, in the order they are tried: module paths that register patterns on import.
#: The residual norm sites come first (they fall through to the plain norm→modulate patterns where
#: they do not apply); the q/k RMSNorm → RoPE site before the RMSNorm→modulate one.
BUILTIN_MODULES = ("adaptiveload.ops.residual_norm_modulate.pattern", "adaptiveload.ops.adaln_modulate.pattern",
                   "adaptiveload.ops.rms_norm_rope.pattern", "adaptiveload.ops.rms_norm_modulate.pattern")


@dataclass
class Match:
    """What a pattern's ``match`` found at one node.

    Attributes:
        candidates: the candidates (see the module doc for the attributes each must have).
        reason: when not None, every candidate is left alone for this reason (e.g. the anchor's
            output also feeds a node outside every candidate).
    """

    candidates: list = field(default_factory=list)
    reason: Optional[str] = None


@dataclass(frozen=True)
class Pattern:
    """A registered pattern (see the module doc)."""

    name: str
    match: Callable[[GraphModule, Node], Optional[Match]]
    check: Callable[[Any, dict], Any]
    replace: Callable[[GraphModule, Any, Any, dict], Node]
    falls_through: bool = False
    rank: int = len(BUILTIN_MODULES)  # the index of its built-in module in BUILTIN_MODULES; others after


_patterns: dict[str, Pattern] = {}
_lock = threading.RLock()
_builtins_loaded = False


def _valid_name(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier()


def register_pattern(name: str, match: Callable, check: Callable, replace: Callable, *,
                     falls_through: bool = False, replace_existing: bool = False) -> Pattern:
    """Register a pattern with the fusion pass; later compiles apply it.

    Args:
        name: an identifier, unique among the registered patterns; it names the counters
            ("<name>.fused", ...) and the report's pattern column.
        match, check, replace: the pattern's functions (see the module doc).
        falls_through: a match it rejects leaves the node to the patterns after it (module doc).
        replace_existing: replace a pattern registered under ``name`` (keeping its place in the
            order) instead of raising.

    Returns:
        The registered :class:`Pattern`.

    Raises:
        ValueError: ``name`` is not an identifier, or is registered and ``replace_existing`` is False.
        TypeError: ``match``, ``check`` or ``replace`` is not callable.
    """
    if not _valid_name(name):
        raise ValueError(f"register_pattern: name must be an identifier (it names counters), got {name!r}")
    for what, fn in (("match", match), ("check", check), ("replace", replace)):
        if not callable(fn):
            raise TypeError(f"register_pattern({name!r}): {what} must be callable, got {type(fn).__name__}")
    caller = sys._getframe(1).f_globals.get("__name__")  # a built-in pattern module ranks by its place
    pattern = Pattern(name, match, check, replace, bool(falls_through),
                      BUILTIN_MODULES.index(caller) if caller in BUILTIN_MODULES else len(BUILTIN_MODULES))
    _load_builtins()
    with _lock:
        if name in _patterns and not replace_existing:
            raise ValueError(f"register_pattern: a pattern named {name!r} is already registered "
                             "(pass replace_existing=True to replace it)")
        if name in _patterns:  # its place in the order stays
            pattern = dataclasses.replace(pattern, rank=_patterns[name].rank)
        _patterns[name] = pattern
    return pattern


def unregister_pattern(name: str) -> Pattern:
    """Remove the pattern registered under ``name`` and return it.

    Raises:
        KeyError: no pattern of that name is registered.
    """
    _load_builtins()
    with _lock:
        if name not in _patterns:
            raise KeyError(f"unregister_pattern: no pattern named {name!r} (registered: {sorted(_patterns)})")
        return _patterns.pop(name)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded:
            return
        _builtins_loaded = True  # first: the built-in modules call register_pattern while importing
        try:
            for module in BUILTIN_MODULES:
                importlib.import_module(module)
        except BaseException:
            _builtins_loaded = False
            raise


def patterns() -> tuple[Pattern, ...]:
    """The registered patterns, in the order the pass tries them (the built-in ones first, imported
    on the first call, in ``BUILTIN_MODULES`` order even when a user imported one of their modules
    first: a module imported during another's import registers after it)."""
    _load_builtins()
    with _lock:
        return tuple(sorted(_patterns.values(), key=lambda p: p.rank))  # stable: registration order within a rank
