"""The backend's post-grad pass: the add after a norm-site backward op, folded into the op.

Where x feeds a norm site and also flows on by another path, x's gradient is the op's dx plus the
gradient of that other path. Wan's block input, for one, feeds ``norm1`` (``adaln_modulate``) and
the first residual (``x + gate·attn``), so the backward graph holds

    add(getitem(adaln_modulate_backward(...), 0), residual_adaln_modulate_backward(...)[0])

and Inductor computes the add in a pointwise kernel of its own: it reads dx and the other gradient
and writes the sum. The norm-site backward ops take that other gradient as ``dx_addend`` and add it
to dx (the CUDA per-sample ring kernel in float32 before rounding dx once to x's dtype, one rounding
fewer than the add after the op, so the results agree within one unit in the last place; the other
CUDA paths after their kernels, as the add did), so the pass rewrites the graph into

    getitem(adaln_modulate_backward(..., dx_addend=t), 0)

which saves a launch and two x-sized moves a site where the add was a kernel of its own (it read dx
and t and wrote the sum; the op reads t; measured in docs/kernels.md, "The gradient added to dx,
folded into the backward op"). It runs as Inductor's ``post_grad_custom_post_pass`` on the graphs that the backend's
inner Inductor compiles (forward and backward; only backward graphs hold these ops), after
Inductor's own post-grad passes.

An add is folded where all of these hold, and left alone otherwise:

* it is ``aten.add.Tensor`` of two tensors (no ``alpha``), one of them output 0 (dx) of a backward
  op of :data:`FOLDABLE` that has no addend yet, used by this add alone;
* the other operand ``t`` has dx's shape, dtype and device (no broadcasting, no type promotion), and
  does not depend on the op's outputs (moving the op after ``t`` must not make a cycle).

The backward ops of the residual and RoPE ops take no addend: the residual op's dx is its ``dr``
plus the norm's gradient already (an addend would be folded into ``dr`` upstream), and the RoPE op's
x is the q or k projection, whose gradient has no second path in the models this library targets.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

import adaptiveload.ops  # noqa: F401  (registers the ops whose backward the pass folds into)

FOLDABLE = frozenset({
    torch.ops.adaptiveload.adaln_modulate_backward.default,
    torch.ops.adaptiveload.rms_norm_modulate_backward.default,
})
COUNTER = "dx_addends"  # torch._dynamo.utils.counters["adaptiveload"][COUNTER]: adds folded


def fold_dx_addends(graph: torch.fx.Graph) -> int:
    """Fold every add after a backward op of :data:`FOLDABLE` that the module doc allows into the op's
    ``dx_addend``; return how many were folded. The graph is changed in place and kept in
    topological order (re-sorted after a fold whose addend came after the op); its nodes need
    ``meta["val"]`` (fake tensors), as Inductor's post-grad graphs and AOTAutograd's graphs have;
    adds without them are left alone."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    folded = 0
    for add in list(graph.nodes):
        if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
            continue
        for dx, other in (add.args, add.args[::-1]):
            op = _foldable_dx(dx)
            if op is not None and _fits(other, dx) and not _depends_on(other, op, order):
                op.kwargs = {**op.kwargs, "dx_addend": other}
                add.replace_all_uses_with(dx)
                graph.erase_node(add)
                folded += 1
                if order[other] > order[op]:  # the op now reads t, which comes after it: sort again, so
                    stable_topological_sort(graph)  # that _depends_on may stop at earlier nodes
                    order = {node: i for i, node in enumerate(graph.nodes)}
                break
    if folded:
        graph.lint()
        torch._dynamo.utils.counters["adaptiveload"][COUNTER] += folded
    return folded


def _foldable_dx(node: Any) -> Optional[torch.fx.Node]:
    """The backward op whose output 0 ``node`` is, if it is one of :data:`FOLDABLE` without an addend
    and ``node`` has one user; else None."""
    if not (isinstance(node, torch.fx.Node) and node.target is operator.getitem and len(node.users) == 1):
        return None
    op, index = node.args
    if not (isinstance(op, torch.fx.Node) and op.target in FOLDABLE and index == 0):
        return None
    if op.kwargs.get("dx_addend") is not None or len(op.args) > _ADDEND_INDEX[op.target]:
        return None
    return op


def _fits(t: Any, dx: torch.fx.Node) -> bool:
    """Whether ``t`` is a tensor node of dx's dtype and device and, provably (no guard added for
    symbolic sizes), of dx's shape."""
    tv, dv = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (t, dx))
    return (isinstance(tv, torch.Tensor) and isinstance(dv, torch.Tensor) and tv.dtype == dv.dtype
            and tv.device == dv.device and statically_known_true(sym_eq(tv.shape, dv.shape)))


def _depends_on(t: torch.fx.Node, op: torch.fx.Node, order: dict) -> bool:
    """Whether ``t`` is computed from ``op``'s outputs (only nodes after ``op`` can be)."""
    stack, seen = [t], set()
    while stack:
        node = stack.pop()
        if node is op:
            return True
        if node in seen or order.get(node, -1) < order[op]:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


# where dx_addend sits among each op's positional arguments (a longer args tuple already passes it)
_ADDEND_INDEX = {op: [a.name for a in op._schema.arguments].index("dx_addend") for op in FOLDABLE}


class FoldDxAddends(CustomGraphPass):
    """:func:`fold_dx_addends` as an Inductor custom graph pass (``post_grad_custom_post_pass``), then
    the pass that was configured there before, if any (``then``). ``uuid`` (the key of Inductor's FX
    graph cache) hashes this file and ``then``'s uuid; None, which turns that cache off as it would
    for ``then`` alone, when ``then`` has no uuid."""

    def __init__(self, then: Optional[Any] = None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        fold_dx_addends(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        if self.then is None:
            return get_hash_for_files((__file__,))
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return None if then is None else (get_hash_for_files((__file__,)), then)
