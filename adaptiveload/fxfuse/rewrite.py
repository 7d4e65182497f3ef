"""``fuse_adaln``: rewrite every chain of an FX graph that a registered pattern matches into its
fused op (``adaln_modulate`` for LayerNorm→modulate, ``rms_norm_modulate`` for RMSNorm→modulate, and
any pattern added with :func:`adaptiveload.fxfuse.register_pattern`).

Pattern, check, replace, count (the structure of Inductor's ``efficient_conv_bn_eval`` pass):

1. visit every node of the graph and, recursively, of the subgraphs of higher-order ops (activation
   checkpointing's ``tag_activation_checkpoint`` above all); the first pattern whose ``match``
   returns candidates there claims the node (``registry.patterns()``, in registration order), but
   a pattern registered ``falls_through`` only when it accepts them;
2. ``check`` each candidate -- every decision is taken before anything is mutated; a match's
   candidates are fused together or not at all, and not where they overlap a candidate accepted
   earlier in the graph;
3. ``replace`` each accepted candidate (its final node's uses go to the fused op's output, the nodes
   this orphaned are erased) and recompile;
4. count: once every graph is rewritten, add the pass's graph and chain counts to
   ``torch._dynamo.utils.counters["adaptiveload"]``, in total and per pattern.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch
from torch.fx import GraphModule, Node

from adaptiveload.fxfuse.nodes import fake_value
from adaptiveload.fxfuse.registry import Pattern, patterns
from adaptiveload.fxfuse.report import ChainRecord, FusionReport

_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def fuse_adaln(gm: GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> FusionReport:
    """Rewrite every chain of ``gm`` (and its subgraphs) that a registered pattern matches, in place.

    Args:
        gm: a Dynamo, ``torch.fx.symbolic_trace`` or ``torch.export`` graph module.
        example_inputs: inputs of ``gm.forward`` (real or fake tensors). Used only when the graph
            carries no fake values (symbolic_trace graphs): they are propagated first, so that shapes
            and dtypes can be checked. Without them such a graph's chains are reported, not fused.

    Returns:
        A :class:`FusionReport` listing every chain seen, fused or skipped with the reason.

    Every chain is matched and checked before the first mutation, so a chain is either fully
    rewritten or not touched. Once the rewrite is done, ``torch._dynamo.utils.counters["adaptiveload"]``
    gets 1 added to "graphs", the report's counts to "seen", "fused", "skipped" and "deferred", and
    each pattern's to "<pattern>.seen", "<pattern>.fused", "<pattern>.skipped", "<pattern>.deferred"
    (nothing when the rewrite raised).

    Fake values are computed without autograd: recording it would run the caller's saved-tensor
    hooks, and activation checkpointing counts what they see, so a graph compiled inside a
    checkpointed forward would fail its recomputation ("a different number of tensors was saved").
    """
    with torch.no_grad():
        return _fuse(gm, example_inputs)


def _fuse(gm: GraphModule, example_inputs: Optional[Sequence[Any]]) -> FusionReport:
    if example_inputs is not None and not _has_fake_values(gm):
        _propagate_fake_values(gm, example_inputs)
    plan = []  # (graph module, [(pattern, candidate, verdict, record)])
    cache: dict = {}
    active = patterns()
    report = FusionReport()
    for name, sub in _graphs(gm):
        plan.append((sub, _collect(name, sub, active, cache, report.deferred)))

    for sub, found in plan:
        replaced: dict[Node, Node] = {}
        for pattern, candidate, verdict, record in found:
            report.chains.append(record)
            if verdict.reason is None:
                pattern.replace(sub, candidate, verdict, replaced)
        if replaced:
            sub.recompile()
    counters = torch._dynamo.utils.counters["adaptiveload"]
    counters["graphs"] += 1
    for prefix, part in (("", report), *((f"{p}.", report.of_pattern(p)) for p in report.patterns())):
        counters[prefix + "seen"] += part.seen
        counters[prefix + "fused"] += part.fused
        counters[prefix + "skipped"] += part.skipped
        counters[prefix + "deferred"] += len(part.deferred)
    return report


# --- graphs ----------------------------------------------------------------------------------


def _graphs(gm: GraphModule, prefix: str = "", seen: Optional[set] = None):
    """``(name, graph module)`` for ``gm`` and every GraphModule reached through a ``get_attr``
    (higher-order-op bodies), depth first; a body used by several calls is visited once."""
    seen = set() if seen is None else seen
    if id(gm) in seen:
        return
    seen.add(id(gm))
    yield prefix, gm
    for node in gm.graph.find_nodes(op="get_attr"):
        attr = _get_attr(gm, node.target)
        if isinstance(attr, GraphModule):
            yield from _graphs(attr, f"{prefix}.{node.target}" if prefix else node.target, seen)


def _get_attr(gm: GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _has_fake_values(gm: GraphModule) -> bool:
    return any(fake_value(n) is not None for n in gm.graph.find_nodes(op="placeholder"))


def _propagate_fake_values(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Record ``meta["val"]`` on every node of a graph that has none (symbolic_trace graphs)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = detect_fake_mode(example_inputs)
    if mode is not None:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
    else:
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


# --- pattern + check -----------------------------------------------------------------------------


def _collect(graph_name: str, gm: GraphModule, active: tuple[Pattern, ...], cache: dict,
             deferred: list[ChainRecord]) -> list[tuple]:
    """``(pattern, candidate, verdict, record)`` for every candidate of every match in ``gm``; the
    records of matches that fell through to a later pattern go to ``deferred``."""
    found = []
    claimed: dict[Node, Node] = {}  # node rewritten by an accepted candidate -> that candidate's anchor
    for node in gm.graph.nodes:
        for pattern in active:
            match = pattern.match(gm, node)
            if match is None or not match.candidates:
                continue
            verdicts = [pattern.check(c, cache) for c in match.candidates]
            group_reason = match.reason
            rejected = [v.reason for v in verdicts if v.reason is not None]
            if group_reason is None and rejected:
                group_reason = f"shares its norm with a chain that is not fused ({rejected[0]})"
            if group_reason is None:
                group_reason = _overlap(match.candidates, claimed)
            if group_reason is not None and pattern.falls_through:
                for candidate, verdict in zip(match.candidates, verdicts):
                    verdict.reason = verdict.reason or group_reason
                    deferred.append(_record(graph_name, pattern, candidate, verdict))
                continue
            for candidate, verdict in zip(match.candidates, verdicts):
                if group_reason is not None and verdict.reason is None:
                    verdict.reason = group_reason
                found.append((pattern, candidate, verdict, _record(graph_name, pattern, candidate, verdict)))
                if verdict.reason is None:
                    claimed.update((n, candidate.anchor) for n in getattr(candidate, "nodes", ()))
            break
    return found


def _overlap(candidates: list, claimed: dict[Node, Node]) -> Optional[str]:
    """Why these candidates may not be fused: a node one of them rewrites is rewritten by a candidate
    accepted before (None if none is)."""
    for candidate in candidates:
        for n in getattr(candidate, "nodes", ()):
            if n in claimed:
                return f"`{n.name}` is rewritten by the fused site of `{claimed[n].name}`"
    return None


def _record(graph_name: str, pattern: Pattern, candidate: Any, verdict: Any) -> ChainRecord:
    return ChainRecord(
        graph=graph_name,
        node=candidate.anchor.name,
        source=_source_line(candidate.final) or _source_line(candidate.anchor),
        norm=candidate.norm,
        affine=candidate.affine,
        variant=candidate.variant,
        layout=verdict.layout,
        reason=verdict.reason,
        pattern=pattern.name,
    )


def _source_line(node: Node) -> str:
    matches = _FILE_LINE.findall(node.meta.get("stack_trace") or "")
    if not matches:
        return ""
    path, line = matches[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"
