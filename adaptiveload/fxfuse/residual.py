"""Residual norm sites: the residual update whose sum feeds a norm site and also flows on as the
residual stream, rewritten with the site into one op that returns both::

    r   = x + gate * y      (x + y)                 r, out, *stats = op(x, y, gate, weight, [bias,] scale,
    out = norm(r) * (1 + scale) + shift      ->                         shift, eps, r_dtype, out_dtype)

(``residual_adaln_modulate`` / ``residual_rms_norm_modulate``). :class:`ResidualNormPattern` is the
norm→modulate pattern of :mod:`adaptiveload.fxfuse.modulate` with a prologue: it matches at the
norm node, ahead of the plain pattern of its family, and falls through to it wherever it rejects a
site (registered ``falls_through``), so every site it leaves is fused as before.

Pattern (:func:`match_prologue`): the norm's input, through exact casts (Wan's ``.float()``), is an
``add`` of two tensors of the sum's shape (exact casts stripped), or one narrowing cast of such an
add (Wan's ``(x.float() + y * gate).type_as(x)``). The operand that is a product (through exact
casts) of y, of the sum's shape, and a gate of a modulation layout of it is the gated branch -- the
second operand when both are, as in ``x + gate * y`` -- and the other is x; any other product is an
ungated y, and with none it is the plain residual ``x + y``. An elementwise function of the gate
(``tanh(gate)``) is an ordinary node in front. r is the last node on the casts from the add to the
norm that another node reads (the residual stream); the casts after it only feed the norm. After
the norm: one modulate chain (any form the plain patterns match), or none (a plain norm, affine or
not: Wan's cross-attention ``norm2``) with its trailing casts. A broadcast add (a modulation's
shift, a bias) is not a residual: no match.

Check (:meth:`ResidualNormPattern.check`): the norm and modulation rules of the plain pattern; the
device switch (``FUSED_DEVICES`` of the op's module: the device types where the op has an
implementation worth fusing into); then the prologue's (:meth:`~ResidualNormPattern.prologue_reason`):
operands floating and on one device; a sum rounded only once on its way to r (one narrowing cast,
from the compute dtype) and not widened before r; the product, the add and the casts to r feeding
only the next of them (the op does not output their values); scale and shift not computed from
the sum; every operand computed before the first node that keeps reading r, or computable there:
the nodes it needs after that point (Wan's ``scale.unsqueeze(1)``, which Python evaluates after the
``x.float()`` of the next residual add) are moved before it when none reads the sum and none has a
side effect; then the op's fake kernel. A normalised tensor feeding several modulations is rejected at the match (the plain
pattern fuses each).

Replace: the op goes before the first node that keeps reading r (or the site's final node), the
operand nodes computed after that point moved in front of it in their order; r's
users read the op's r, the final node's users its out; the add, the product, the casts and the norm
chain die. Rounding: r is summed in float32 and rounded once to r's dtype; a product that eager
rounds first (Flux's bf16 ``gate * y``) is not rounded, as Inductor's fused kernel does not round it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

from torch.fx import GraphModule, Node

from adaptiveload.fxfuse.modulate import (NO_METADATA, Chain, ChainValues, NormModulatePattern, Verdict, call_fused,
                                          describe_fake, erase_unused, fake_outputs, graph_value, norm_operands,
                                          plain_norm_chain, segmented_rows, site_chains)
from adaptiveload.fxfuse.nodes import (NormSite, binary_operands, cast_source, computed_from, device_of, fake_value,
                                       is_floating, narrows, norm_site, static_dims, strip_exact_casts)
from adaptiveload.fxfuse.registry import Match
from adaptiveload.ops import modulation_layout
from adaptiveload.ops.common import compute_dtype


@dataclass
class Prologue:
    """The residual update in front of a norm.

    Attributes:
        add: the ``add`` node.
        residual: the node holding r: of ``add`` and the casts from it to the norm's input (one
            narrowing cast of the add, Wan's ``.type_as(x)``, then exact ones), the last that a node
            other than the next cast or the norm reads (the residual stream), else the add or its
            narrowing cast.
        to_residual: the casts from ``add`` to ``residual``, in graph order (each must feed only the
            next).
        to_norm: the exact casts from ``residual`` to the norm's input, which only the norm reads.
        x, y, gate: the op's operands (exact casts stripped; gate None for a plain residual).
        written: the operands as the graph wrote them (``x``, ``y``, ``gate``), used where a stripped
            one was erased by an earlier rewrite.
        product: the ``gate * y`` node (None for a plain residual).
        branch_casts: the exact casts from the product to the add (Wan's ``.float()`` of a bf16 product).
        absorbed: the exact casts stripped from the operands (they die with the site when unused).
    """

    add: Node
    residual: Node
    to_residual: list[Node]
    to_norm: list[Node]
    x: Node
    y: Node
    gate: Optional[Node]
    written: tuple
    product: Optional[Node] = None
    branch_casts: list[Node] = field(default_factory=list)
    absorbed: list[Node] = field(default_factory=list)

    @property
    def variant(self) -> str:
        return "x+y" if self.gate is None else "x+gate*y"

    @property
    def nodes(self) -> list[Node]:
        """The nodes the rewrite replaces, in graph order: the product, its casts, the add, the casts
        to r (each feeding only the next), then the casts from r to the norm."""
        own = [self.product, *reversed(self.branch_casts), self.add, *self.to_residual, *self.to_norm]
        return [n for n in own if n is not None]


@dataclass
class ResidualSite:
    """A candidate of :class:`ResidualNormPattern`: a prologue and the norm chain after it (see
    ``adaptiveload.fxfuse.registry`` for the attributes a candidate has)."""

    prologue: Prologue
    chain: Chain

    @property
    def anchor(self) -> Node:
        return self.chain.site.node

    @property
    def final(self) -> Node:
        return self.chain.final

    @property
    def norm(self) -> str:
        return self.chain.site.kind

    @property
    def affine(self) -> bool:
        return self.chain.site.affine

    @property
    def variant(self) -> str:
        return f"{self.prologue.variant} -> {self.chain.variant}"

    @property
    def nodes(self) -> list[Node]:
        return [*self.prologue.nodes, *self.chain.nodes]


def _tensor_operands(node: Any, kind: str) -> Optional[tuple[Node, Node]]:
    ops = binary_operands(node, kind)
    if ops is None or not all(isinstance(o, Node) for o in ops):
        return None
    return ops


def _dims(node: Any) -> Optional[list]:
    val = fake_value(node)
    return None if val is None else static_dims(val.shape)


def _is_layout(node: Node, r_dims: list) -> bool:
    try:
        modulation_layout(_dims(node), r_dims)
    except (ValueError, TypeError):
        return False
    return True


def match_prologue(site: NormSite) -> Optional[Prologue]:
    """The :class:`Prologue` whose sum the norm of ``site`` reads (through casts), or None when the
    norm's input is not a residual sum: an add of two tensors of the sum's shape (exact casts
    stripped), one of which may be a gated branch ``gate * y`` (y of the sum's shape, gate a
    modulation layout of it; any other product is an ungated y). Needs the graph's fake values."""
    start, exact = strip_exact_casts(site.input)
    add = start
    source = cast_source(start)
    if source is not None and narrows(start):
        add = source
    ops = _tensor_operands(add, "add")
    r_dims = _dims(add)
    if ops is None or r_dims is None:
        return None
    path = [add, *([start] if start is not add else []), *reversed(exact)]  # add ... the norm's input
    norm_reads = {site.node, *site.internal}
    at = 0  # r: the last node of the path read by a node other than the next one or the norm
    for i, node in enumerate(path):
        following = path[i + 1] if i + 1 < len(path) else None
        if any(u is not following and u not in norm_reads for u in node.users):
            at = i
    # r is at or after the narrowing cast, whose rounded value the norm reads (an unrounded sum that
    # other nodes read is rejected by the check)
    at = max(at, 1 if start is not add else 0)
    frame = dict(add=add, residual=path[at], to_residual=path[1:at + 1], to_norm=path[at + 1:])
    stripped = [strip_exact_casts(o)[0] for o in ops]
    if any(_dims(o) != r_dims for o in stripped):
        return None  # a broadcast add (a modulation's shift, a bias), not a residual update
    for x_written, branch_written in (ops, ops[::-1]):  # a gated branch, the second operand first
        product, branch_casts = strip_exact_casts(branch_written)
        factors = _tensor_operands(product, "mul")
        roles = None if factors is None else _y_and_gate(factors, r_dims)
        if roles is not None:
            absorbed: list[Node] = []
            x, y, gate = (_strip(n, absorbed) for n in (x_written, *roles))
            return Prologue(**frame, x=x, y=y, gate=gate, written=(x_written, *roles), product=product,
                            branch_casts=branch_casts, absorbed=absorbed)
    absorbed = []
    x, y = (_strip(n, absorbed) for n in ops)
    return Prologue(**frame, x=x, y=y, gate=None, written=(*ops, None), absorbed=absorbed)


def _strip(node: Node, absorbed: list[Node]) -> Node:
    stripped, passed = strip_exact_casts(node)
    absorbed.extend(passed)
    return stripped


def _y_and_gate(factors: tuple[Node, Node], r_dims: list) -> Optional[tuple[Node, Node]]:
    """``(y, gate)`` as written, of a product's two factors: y of r's shape and gate a modulation
    layout of r (exact casts stripped to decide), the broadcasting one as gate when only one
    broadcasts, else the second; None when neither assignment fits (the product is then an ungated
    y)."""
    p, q = (strip_exact_casts(f)[0] for f in factors)
    fits = [(y, gate) for (y, gate), (ys, gs) in ((factors, (p, q)), (factors[::-1], (q, p)))
            if _dims(ys) == r_dims and _is_layout(gs, r_dims)]
    broadcasting = [(y, gate) for y, gate in fits if _dims(strip_exact_casts(gate)[0]) != r_dims]
    return (broadcasting or fits or [None])[0]


@dataclass(frozen=True)
class ResidualNormPattern(NormModulatePattern):
    """The match / check / replace of one residual norm-site op (module doc; registered
    ``falls_through``, ahead of the plain pattern of its family).

    Attributes (besides :class:`NormModulatePattern`'s, whose ``op`` is here the residual op, called
    as ``op(x, y, gate, weight, [bias,] scale, shift, eps, r_dtype, out_dtype)`` and returning
    ``(r, out, *statistics)``):
        devices: the device types on which the op is fused (the op module's ``FUSED_DEVICES``).
    """

    devices: frozenset = frozenset()

    def match(self, gm: GraphModule, node: Node) -> Optional[Match]:
        """The residual site of ``node``, when it is a norm of this pattern's family whose input is a
        residual sum; the match's reason rejects it when the normalised tensor is needed elsewhere
        or feeds several modulations."""
        site = norm_site(gm, node)
        if site is None or site.family != self.family or fake_value(site.output) is None:
            return None
        prologue = match_prologue(site)
        if prologue is None:
            return None
        chains, reason = site_chains(site)
        if not chains:  # a plain norm: every user of its output reads the op's out
            return Match([ResidualSite(prologue, plain_norm_chain(site))])
        if len(chains) > 1:
            reason = reason or f"the normalised tensor feeds {len(chains)} modulations (one op each)"
        return Match([ResidualSite(prologue, chains[0])], reason)

    def check(self, site: ResidualSite, fake_cache: Optional[dict] = None) -> Verdict:
        """Decide whether ``site`` may be replaced by the op, before anything is mutated (module doc
        for what is rejected)."""
        verdict, values = self.check_chain(site.chain)
        if verdict.reason is not None:
            return verdict
        device = device_of(values.x)
        if device.type not in self.devices:
            verdict.reason = f"no validated {device.type.upper()} kernel for {self.name} yet (FUSED_DEVICES)"
            return verdict
        inputs, gate_layout, verdict.reason = self.prologue_values(site)
        if verdict.reason is not None:
            return verdict
        if gate_layout is not None:
            verdict.layout = f"gate {gate_layout}; {verdict.layout}"
        verdict.reason = self.prologue_reason(site, verdict, values, inputs)
        if verdict.reason is not None:
            return verdict
        tensors = (*inputs, *self.norm_args(values.weight, values.bias, values.scale, values.shift))
        r_val = fake_value(site.prologue.residual)
        scalars = (verdict.eps, r_val.dtype, values.final.dtype)
        try:
            verdict.fake_outputs = fake_outputs(self.op, values.fake_mode, tensors, scalars, (r_val, values.final),
                                                fake_cache)
        except (ValueError, RuntimeError) as err:
            verdict.reason = f"the fused op rejects the inputs: {err}"
            return verdict
        self._check_segmented_site(site, verdict, values, inputs, scalars, fake_cache)
        return verdict

    def _check_segmented_site(self, site: ResidualSite, verdict: Verdict, values: ChainValues, inputs: tuple,
                              scalars: tuple, fake_cache: Optional[dict]) -> None:
        """Plan the segmented op (``verdict.segmented``, its layout and fake outputs) when the gate,
        scale and shift present are all gathered to the tokens from per-segment rows by one set of
        segment ids (:func:`~adaptiveload.fxfuse.modulate.segmented_rows`); else leave the verdict
        (per-token modulation) as it is."""
        chain, r_val = site.chain, fake_value(site.prologue.residual)
        if self.segmented_op is None or chain.scale_view is not None:
            return
        seg = segmented_rows({"gate": site.prologue.gate, "scale": chain.scale, "shift": chain.shift},
                             static_dims(r_val.shape))
        if seg is None:
            return
        seg.plan(values.fake_mode)
        tensors = (*inputs[:2], seg.values.get("gate"),
                   *self.norm_args(values.weight, values.bias, seg.values.get("scale"), seg.values.get("shift")),
                   seg.ids_val)
        try:
            outputs = fake_outputs(self.segmented_op, values.fake_mode, tensors, scalars, (r_val, values.final),
                                   fake_cache)
        except (ValueError, RuntimeError):
            return
        verdict.fake_outputs, verdict.segmented = outputs, seg
        verdict.layout = f"segmented {', '.join(seg.rows)}"

    def norm_args(self, weight, bias, scale, shift) -> tuple:
        """The op's norm and modulation arguments in its order: the bias only if the op takes one."""
        return (weight, bias, scale, shift) if self.has_bias else (weight, scale, shift)

    def prologue_values(self, site: ResidualSite) -> tuple[tuple, Optional[str], Optional[str]]:
        """``((x, y, gate), gate layout, reason)``: the operands' fake values (gate and its layout
        None without a gate; shapes and layout as :func:`match_prologue` found them) and why they
        cannot be the op's (None if they can): missing, or not floating."""
        prologue = site.prologue
        r_val = fake_value(prologue.residual)
        vals = {name: fake_value(getattr(prologue, name)) for name in ("x", "y", "gate")}
        inputs = tuple(vals.values())
        needed = [v for name, v in vals.items() if name != "gate" or prologue.gate is not None]
        if r_val is None or any(v is None for v in needed):
            return inputs, None, NO_METADATA
        for name, val in vals.items():
            if val is not None and not is_floating(val):
                return inputs, None, f"residual {describe_fake(name, val)} is not floating point"
        if vals["gate"] is None:
            return inputs, None, None
        return inputs, modulation_layout(static_dims(vals["gate"].shape), static_dims(r_val.shape)), None

    def prologue_reason(self, site: ResidualSite, verdict: Verdict, values: ChainValues,
                        inputs: tuple) -> Optional[str]:
        """Why the prologue may not be folded into the op (None if it may): see the module doc."""
        prologue, chain = site.prologue, site.chain
        add, r_val = prologue.add, fake_value(prologue.residual)
        devices = {device_of(t) for t in (r_val, *inputs) if t is not None}
        if len(devices) != 1:
            return f"residual tensors on several devices {sorted(map(str, devices))}"
        steps = prologue.to_residual
        rounds = bool(steps) and narrows(steps[0])  # the match allows one narrowing cast, the first
        for prev, node in zip([add, *steps], steps):
            if node is not steps[0] or not rounds:
                if fake_value(node).dtype != fake_value(prev).dtype:
                    return f"`{node.name}` widens the sum `{add.name}` before other nodes read it"
        add_dtype = fake_value(add).dtype
        if rounds and add_dtype != compute_dtype(*inputs, values.weight, values.bias, values.scale, values.shift):
            return (f"the sum `{add.name}` is rounded to {add_dtype} and again to {r_val.dtype} by "
                    f"`{steps[0].name}` (the op rounds once)")
        path = [*([prologue.product] if prologue.product is not None else []), *reversed(prologue.branch_casts),
                add, *prologue.to_residual]
        for node, successor in zip(path, path[1:]):
            outside = [u for u in node.users if u is not successor]
            if outside:
                return f"`{node.name}` also feeds `{outside[0].name}`, which the op does not output"
        for name in ("scale", "shift"):
            operand = getattr(chain, name)
            if computed_from(operand, add):
                return f"{name} `{operand.name}` is computed from the residual sum `{add.name}`"
        point = self._insertion_point(site, verdict)
        _, reason = _nodes_to_move(self._operand_nodes(site, verdict), point, add)
        return reason
        return None

    @staticmethod
    def _operand_nodes(site: ResidualSite, verdict: Verdict) -> list[Node]:
        """The graph nodes the op reads (before any rewrite), the scale view's inputs included."""
        prologue, chain = site.prologue, site.chain
        nodes = [prologue.x, prologue.y, prologue.gate, verdict.weight, verdict.bias, chain.scale, chain.shift]
        if chain.scale_view is not None:
            nodes += [n for n in chain.scale_view.all_input_nodes if n is not chain.scale_view.args[0]]
        return [n for n in nodes if isinstance(n, Node)]

    @staticmethod
    def _insertion_point(site: ResidualSite, verdict: Verdict) -> Node:
        """The node before which the op goes: the first node that keeps reading r (not the norm or
        the casts into it), or the site's final node if none comes before it."""
        chain, prologue = site.chain, site.prologue
        norm_reads = {chain.site.node, *chain.site.internal, *prologue.to_norm}
        readers = [u for u in prologue.residual.users if u not in norm_reads]
        return min([*readers, chain.final])

    def replace(self, gm: GraphModule, site: ResidualSite, verdict: Verdict, replaced: dict[Node, Node]) -> Node:
        """Replace r and the site's final node by ``getitem(op(...), 0)`` and ``getitem(op(...), 1)``
        and erase what that orphaned; returns the second getitem (``replaced`` records both).

        Raises:
            RuntimeError: an operand, after an earlier rewrite of this graph, is defined after the
                point the op must precede (the backend then compiles the unfused graph).
        """
        graph, prologue, chain = gm.graph, site.prologue, site.chain
        point = self._insertion_point(site, verdict)
        operands = [graph_value(n, replaced) for n in self._operand_nodes(site, verdict)]
        move, reason = _nodes_to_move([n for n in operands if isinstance(n, Node) and not n._erased], point, prologue.add)
        if reason is not None:
            raise RuntimeError(f"{self.name}: {reason}")
        for node in move:  # in graph order, each in front of the point
            point.prepend(node)
        with graph.inserting_before(point):
            _, weight, bias, scale, shift = norm_operands(graph, chain, verdict, replaced)
            x, y, gate = (graph_value(w if v._erased and v not in replaced else v, replaced) if v is not None else None
                          for v, w in zip((prologue.x, prologue.y, prologue.gate), prologue.written))
            op, ids, seg = self.op, (), verdict.segmented
            if seg is not None:  # the per-segment rows and the ids instead of the gathered tensors
                rows, segment_ids = seg.graph_nodes(graph, replaced)
                op, ids = self.segmented_op, (segment_ids,)
                gate, scale, shift = rows.get("gate"), rows.get("scale"), rows.get("shift")
            late = [n for n in (x, y, gate, weight, bias, scale, shift) if isinstance(n, Node) and not n < point]
            if late:
                raise RuntimeError(f"{self.name}: `{late[0].name}` is defined after `{point.name}`")
            args = (x, y, gate, *self.norm_args(weight, bias, scale, shift), *ids, verdict.eps,
                    fake_value(prologue.residual).dtype, fake_value(chain.final).dtype)
            _, out = call_fused(graph, op, args, verdict.fake_outputs, (prologue.residual, chain.final), replaced)
        site_nodes = chain.site
        dead = [*chain.nodes, *chain.leftovers, site_nodes.output, *site_nodes.node.users, site_nodes.node,
                *site_nodes.internal, *verdict.absorbed, *prologue.nodes, *prologue.absorbed,
                *(seg.nodes if seg is not None else ())]
        erase_unused(graph, dead)
        return out


def _nodes_to_move(operands: list[Node], point: Node, add: Node) -> tuple[list[Node], Optional[str]]:
    """The nodes at or after ``point`` that computing ``operands`` needs, in graph order, to be moved in
    front of ``point`` (the first node that keeps reading the residual sum ``add``); or, when one of
    them may not move (it reads the sum, or is not :func:`_movable`), ``([], reason)``."""
    move, stack = set(), [n for n in operands if not n < point]
    while stack:
        node = stack.pop()
        if node in move or node < point:
            continue
        if computed_from(node, add):
            return [], f"`{node.name}` is computed from the residual sum after `{point.name}` reads it"
        if not _movable(node):
            return [], f"`{node.name}` is computed after `{point.name}`, which reads the residual sum, and cannot move"
        move.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(move), None


def _movable(node: Node) -> bool:
    """A node that may run earlier: an attribute read, or a function or method call without side
    effects (FX's ``is_impure``: mutating schemas, random ops) that is not an in-place ``*_`` call
    (dunder methods such as ``__getitem__`` are not in-place) or augmented assignment (``+=``);
    not a placeholder, module call or output."""
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method") or node.is_impure() or node.target in _IN_PLACE_OPERATORS:
        return False
    name = (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")).split(".")[0]
    return not name.endswith("_") or name.endswith("__")  # `add_` mutates; `__getitem__` does not


# what Dynamo records for `t += ...` and the like: they mutate their first operand
_IN_PLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                 operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
                                 operator.ixor, operator.ilshift, operator.irshift})
