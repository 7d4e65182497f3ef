"""``fuse_adaln``: rewrite every LayerNorm→modulate chain of an FX graph into the fused op.

Pattern, check, replace, count (the structure of Inductor's ``efficient_conv_bn_eval`` pass):

1. find every norm call (``nodes.norm_site``) in the graph and, recursively, in the subgraphs of
   higher-order ops (activation checkpointing's ``tag_activation_checkpoint`` above all);
2. from each norm's output, through dtype casts, try the matchers of ``patterns.py`` on every user,
   keeping the chains that modulate it (``patterns.modulates``);
3. ``patterns.check`` each chain -- every decision is taken before anything is mutated;
4. replace each accepted chain's final node by
   ``getitem(torch.ops.adaptiveload.adaln_modulate.default(x, weight, bias, scale, shift, eps, out_dtype), 0)``,
   erase the nodes this orphaned (and only those) and recompile;
5. count: once every graph is rewritten, add the pass's graph and chain counts to
   ``torch._dynamo.utils.counters["adaptiveload"]``.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Optional, Sequence

import torch
from torch.fx import GraphModule, Node

from adaptiveload.fxfuse.nodes import NormSite, ParamRef, cast_source, fake_value, norm_site, times_one_operand
from adaptiveload.fxfuse.patterns import (
    FUSED_OP,
    MATCHERS,
    NO_METADATA,
    REPORT_ONLY_MATCHERS,
    Chain,
    Verdict,
    check,
    modulates,
)
from adaptiveload.fxfuse.report import ChainRecord, FusionReport

_META_KEYS = ("val", "example_value")
_COPIED_META = ("stack_trace", "nn_module_stack")
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def fuse_adaln(gm: GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> FusionReport:
    """Rewrite every LayerNorm→modulate chain of ``gm`` (and its subgraphs) in place.

    Args:
        gm: a Dynamo, ``torch.fx.symbolic_trace`` or ``torch.export`` graph module.
        example_inputs: inputs of ``gm.forward`` (real or fake tensors). Used only when the graph
            carries no fake values (symbolic_trace graphs): they are propagated first, so that shapes
            and dtypes can be checked. Without them such a graph's chains are reported, not fused.

    Returns:
        A :class:`FusionReport` listing every chain seen, fused or skipped with the reason.

    Every chain is matched and checked before the first mutation, so a chain is either fully
    rewritten or not touched. Once the rewrite is done, ``torch._dynamo.utils.counters["adaptiveload"]``
    gets 1 added to "graphs" and the report's counts to "seen", "fused" and "skipped" (nothing when
    the rewrite raised).

    Fake values are computed without autograd: recording it would run the caller's saved-tensor
    hooks, and activation checkpointing counts what they see, so a graph compiled inside a
    checkpointed forward would fail its recomputation ("a different number of tensors was saved").
    """
    with torch.no_grad():
        return _fuse(gm, example_inputs)


def _fuse(gm: GraphModule, example_inputs: Optional[Sequence[Any]]) -> FusionReport:
    if example_inputs is not None and not _has_fake_values(gm):
        _propagate_fake_values(gm, example_inputs)
    plan = []  # (graph module, [(chain, verdict, record)])
    fake_cache: dict = {}
    for name, sub in _graphs(gm):
        plan.append((sub, _collect(name, sub, fake_cache)))

    report = FusionReport()
    for sub, found in plan:
        replaced: dict[Node, Node] = {}
        for chain, verdict, record in found:
            report.chains.append(record)
            if verdict.reason is None:
                replace_chain(sub, chain, verdict, replaced)
        if replaced:
            sub.recompile()
    counters = torch._dynamo.utils.counters["adaptiveload"]
    counters["graphs"] += 1
    counters["seen"] += report.seen
    counters["fused"] += report.fused
    counters["skipped"] += report.skipped
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


def _collect(graph_name: str, gm: GraphModule, fake_cache: dict) -> list[tuple[Chain, Verdict, ChainRecord]]:
    found = []
    for node in gm.graph.nodes:
        site = norm_site(gm, node)
        if site is None:
            continue
        chains, tree, outside = _chains_of(site)
        verdicts = [check(chain, fake_cache) for chain in chains]
        site_reason = _site_reason(site, outside, verdicts)
        for chain, verdict in zip(chains, verdicts):
            if site_reason is not None and verdict.reason is None:
                verdict.reason = site_reason
            chain.leftovers = [*chain.leftovers, *reversed(tree[1:])]
            found.append((chain, verdict, _record(graph_name, chain, verdict)))
    return found


def _chains_of(site: NormSite) -> tuple[list[Chain], list[Node], list[Node]]:
    """The chains starting from ``site``'s normalised tensor, the "norm tree" (its output, dtype casts
    of it and ``* 1`` of it), and the tree's users that belong to no chain."""
    tree, chains, claimed = [site.output], [], set()
    for matchers in (MATCHERS, REPORT_ONLY_MATCHERS):
        for value in tree:  # grows while iterating: casts of the normalised tensor join the tree
            for user in list(value.users):
                if user in claimed or user in tree:
                    continue
                if matchers is MATCHERS and (cast_source(user) is value or times_one_operand(user) is value):
                    tree.append(user)
                    continue
                for match in matchers:
                    chain = match(value, user)
                    if chain is not None and modulates(chain, site):
                        chain.site = site
                        chains.append(chain)
                        claimed.update(chain.nodes)
                        break
    outside = [u for v in tree for u in v.users if u not in claimed and u not in tree]
    return chains, tree, outside


def _site_reason(site: NormSite, outside: list[Node], verdicts: list[Verdict]) -> Optional[str]:
    """A reason that rejects every chain of ``site``: the normalised tensor is needed elsewhere."""
    if fake_value(site.output) is None and site.kind != "RMSNorm":
        return NO_METADATA
    if outside:
        return f"normalised tensor also feeds `{outside[0].name}` outside the chain"
    rejected = [v.reason for v in verdicts if v.reason is not None]
    if rejected:
        return f"shares its norm with a chain that is not fused ({rejected[0]})"
    return None


def _record(graph_name: str, chain: Chain, verdict: Verdict) -> ChainRecord:
    site = chain.site
    return ChainRecord(
        graph=graph_name,
        node=site.node.name,
        source=_source_line(chain.final) or _source_line(site.node),
        norm=site.kind,
        affine=site.affine,
        variant=chain.variant,
        layout=verdict.layout,
        reason=verdict.reason,
    )


def _source_line(node: Node) -> str:
    matches = _FILE_LINE.findall(node.meta.get("stack_trace") or "")
    if not matches:
        return ""
    path, line = matches[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


# --- replace ---------------------------------------------------------------------------------


def replace_chain(gm: GraphModule, chain: Chain, verdict: Verdict, replaced: dict[Node, Node]) -> Node:
    """Replace ``chain.final`` by ``getitem(adaln_modulate(...), 0)`` and erase what that orphaned.

    ``replaced`` maps final nodes already replaced in this graph to their replacement (a chain's
    input may be an earlier chain's final node); it is updated. Returns the new getitem node.
    """
    graph, final = gm.graph, chain.final
    site, (y_val, mean_val, rstd_val) = chain.site, verdict.fake_outputs

    def operand(value: Any, as_written: Any = None) -> Any:
        if isinstance(value, ParamRef):
            node = graph.get_attr(value.qualname)
            node.meta["val"] = fake_value(final).fake_mode.from_tensor(value.tensor, static_shapes=True)
            return node
        if isinstance(value, Node) and value._erased:
            # the upcasts stripped from x led into a chain rewritten before: use the cast's result,
            # i.e. that chain's replacement (the same values the norm read)
            value = as_written
        while value in replaced:
            value = replaced[value]
        return value

    with graph.inserting_before(final):
        scale = operand(chain.scale)
        if chain.scale_view is not None:  # (1 + scale)[:, None]: the same view, of scale
            one_plus, scale_source = chain.scale_view.args[0], scale
            scale = graph.node_copy(chain.scale_view, lambda n: scale_source if n is one_plus else n)
            _set_fake_value(scale, _fake_eval(scale, fake_value(final).fake_mode))
        args = (
            operand(verdict.x, site.input),
            operand(verdict.weight, site.weight),
            operand(verdict.bias, site.bias),
            scale,
            operand(chain.shift),
            float(site.eps),
            fake_value(final).dtype,
        )
        fused = graph.call_function(FUSED_OP, args)
        out = graph.call_function(operator.getitem, (fused, 0))
    for key in _META_KEYS:
        if key in final.meta:
            fused.meta[key] = (y_val, mean_val, rstd_val)
            out.meta[key] = y_val
    if "tensor_meta" in final.meta:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        out.meta["tensor_meta"] = _extract_tensor_metadata(y_val)
    for key in _COPIED_META:
        if key in final.meta:
            fused.meta[key] = out.meta[key] = final.meta[key]

    final.replace_all_uses_with(out)
    replaced[final] = out
    dead = [*reversed(chain.nodes), *chain.leftovers]
    if site.output is not site.node:
        dead += [site.output, *(u for u in site.node.users if u is not site.output)]
    dead += [site.node, *verdict.absorbed]
    _erase_unused(graph, dead)
    return out


def _fake_eval(node: Node, fake_mode) -> Any:
    """Run one node on the fake values of its inputs."""
    args, kwargs = torch.fx.node.map_arg(
        (node.args, node.kwargs), lambda n: n.meta.get("val", n.meta.get("example_value"))
    )
    with fake_mode:
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def _set_fake_value(node: Node, value: Any) -> None:
    for key in _META_KEYS:
        if key in node.meta:
            node.meta[key] = value


def _erase_unused(graph: torch.fx.Graph, candidates: list[Node]) -> None:
    """Erase each candidate (in the order given) that no longer has users; nothing else."""
    for node in candidates:
        if isinstance(node, Node) and node.graph is graph and not node.users and not node._erased:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            graph.erase_node(node)
