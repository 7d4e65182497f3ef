"""Norm→modulate chains, shared by the patterns of every norm→modulate op (``adaln_modulate``,
``rms_norm_modulate``): how a chain ``norm(x) * (1 + scale) [+ shift]`` is recognised after a norm
(pattern), the rules that decide whether one may be fused (check), and its rewrite into the op
(replace). :class:`NormModulatePattern` bundles the three for one op; each op's ``pattern.py``
registers one (``adaptiveload.fxfuse.register_pattern``).

Pattern: each modulate form has one named matcher ``match_*(value, user)``: ``value`` holds the
normalised tensor (the norm's output, or a dtype cast of it) and ``user`` is one of its users. A
matcher returns a :class:`Chain` when the nodes from ``user`` on have the form's shape, None
otherwise. Matchers only look at graph structure; they never mutate anything.

* :func:`match_mul_add`         ``norm * (1 + scale) [+ shift]`` (also ``(scale + 1)``, either operand order)
* :func:`match_addcmul`         ``torch.addcmul(shift, norm, 1 + scale)``
* :func:`match_norm_plus_scaled` ``norm + norm * scale [+ shift]``
* :func:`match_unscaled`        ``norm * scale [+ shift]`` with no ``1 +``: reported, never fused

Each form may be written with operators, ``torch.mul/add``, Tensor methods (``.mul``, ``.add``) or
aten overloads. Trailing dtype casts (each the previous node's only user) are part of the chain up
to the last narrowing (Wan's ``.type_as(x)`` back to bf16; the ``.half()`` of ``.half().float()``):
the op outputs that dtype, and a widening after it stays in the graph (see ``_with_tail``).

A match is a chain only if it modulates (:func:`modulates`): scale and shift are computed without
the normalised tensor. That keeps out RoPE after a q/k norm, ``x * cos + rotate(x) * sin``.

Check: :meth:`NormModulatePattern.check` returns a :class:`Verdict` whose ``reason`` says why a
chain is left alone, or None when the fused op provably computes what the chain computed (shapes,
dtypes and devices from the graph's fake values; the op's own fake kernel run on them as the last
word).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule, Node

from adaptiveload.fxfuse.nodes import (
    NormSite,
    ParamRef,
    addcmul_operands,
    binary_operands,
    cast_source,
    computed_from,
    device_of,
    fake_value,
    is_floating,
    narrows,
    norm_site,
    one_plus_operand,
    rms_norm_default_eps,
    static_dims,
    strip_exact_casts,
    times_one_operand,
    view_source,
)
from adaptiveload.fxfuse.registry import Match
from adaptiveload.ops import modulation_layout

NO_METADATA = "no shape metadata on the graph (a symbolic_trace graph: pass example_inputs to fuse_adaln)"

@dataclass
class Chain:
    """A candidate norm→modulate chain, as found by a matcher.

    Attributes:
        variant: the family and form, e.g. "norm*(1+scale)+shift", "addcmul", "norm+norm*scale".
        value: the node holding the normalised tensor that the modulate consumes.
        nodes: the modulate's nodes in graph order; ``nodes[-1]`` is the final node, whose value the
            fused op replaces. Every other node must have no user outside ``nodes``.
        scale, shift: the graph's modulation nodes (shift None for a scale-only chain).
        scale_view: for ``(1 + scale)[:, None]`` (diffusers' AdaLayerNormContinuous), the view node
            of ``1 + scale``; the rewrite applies the same view to ``scale``.
        leftovers: nodes the chain reads that may die with it but may also be shared (``1 + scale``).
        rejection: a reason fixed by the pattern itself (the chain can never be fused).
        site: the norm the chain starts from (set by the caller).
    """

    variant: str
    value: Node
    nodes: list[Node]
    scale: Node
    shift: Optional[Node]
    leftovers: list[Node] = field(default_factory=list)
    rejection: Optional[str] = None
    site: Optional[NormSite] = None
    scale_view: Optional[Node] = None

    @property
    def final(self) -> Node:
        return self.nodes[-1]

    # what the report shows (see adaptiveload.fxfuse.registry)
    @property
    def anchor(self) -> Node:
        return self.site.node

    @property
    def norm(self) -> str:
        return self.site.kind

    @property
    def affine(self) -> bool:
        return self.site.affine


def _other(ops: Optional[tuple], value: Node) -> Any:
    """The operand of a binary node that is not ``value`` (None if ``value`` is not an operand)."""
    if ops is None:
        return None
    a, b = ops
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _shift_step(node: Node) -> Optional[tuple[Node, Node]]:
    """``(add, shift)`` for the first user of ``node`` that adds a tensor ``shift`` to it."""
    for user in node.users:
        shift = _other(binary_operands(user, "add"), node)
        if isinstance(shift, Node):
            return user, shift
    return None


def _with_tail(nodes: list[Node]) -> list[Node]:
    """Extend ``nodes`` by the dtype casts after them that the fused op takes in.

    Of the casts that follow (each the previous node's only user), the op takes those up to the last
    narrowing (:func:`~adaptiveload.fxfuse.nodes.narrows`) and the casts to that same dtype right
    after it: it then outputs the dtype the chain's value was last rounded to, rounding and
    overflowing where the chain did. A widening after it (the ``.float()`` of ``.half().float()``)
    stays in the graph and reads the op's output. Without a narrowing, casts to the chain's own
    dtype (Wan's ``.type_as(x)`` of a float32 stream) are taken, a widening is not.
    """
    casts, last = [], nodes[-1]
    while len(last.users) == 1 and cast_source(next(iter(last.users))) is last:
        last = next(iter(last.users))
        casts.append(last)
    if not casts:
        return nodes
    chain = nodes + casts
    end = len(nodes) + max((i + 1 for i, cast in enumerate(casts) if narrows(cast)), default=0)
    dtype = fake_value(chain[end - 1]).dtype
    while end < len(chain) and fake_value(chain[end]).dtype == dtype:
        end += 1
    return chain[:end]


def _finish(variant: str, value: Node, nodes: list[Node], scale: Node, leftovers: list[Node]) -> Chain:
    step = _shift_step(nodes[-1])
    shift = None
    if step is not None:
        nodes.append(step[0])
        shift = step[1]
    suffix = "+shift" if shift is not None else ""
    return Chain(variant + suffix, value, _with_tail(nodes), scale, shift, leftovers)


def _one_plus(factor: Any) -> Optional[tuple[Node, Optional[Node], list[Node]]]:
    """``(scale, view, nodes)`` when ``factor`` is ``1 + scale`` or a view of it (``(1 + scale)[:, None]``);
    ``nodes`` are the factor's own nodes (dead once the chain is fused, unless shared)."""
    scale = one_plus_operand(factor)
    if scale is not None:
        return scale, None, [factor]
    source = view_source(factor)
    scale = one_plus_operand(source)
    if scale is not None:
        return scale, factor, [factor, source]
    return None


def match_mul_add(value: Node, user: Node) -> Optional[Chain]:
    """``norm * (1 + scale) [+ shift]``: ``user`` multiplies ``value`` by ``1 + scale``."""
    one_plus = _one_plus(_other(binary_operands(user, "mul"), value))
    if one_plus is None:
        return None
    scale, view, factor_nodes = one_plus
    chain = _finish("norm*(1+scale)", value, [user], scale, factor_nodes)
    chain.scale_view = view
    return chain


def match_addcmul(value: Node, user: Node) -> Optional[Chain]:
    """``torch.addcmul(shift, norm, 1 + scale)`` (tensor1 and tensor2 in either order)."""
    ops = addcmul_operands(user)
    if ops is None:
        return None
    shift, t1, t2 = ops
    one_plus = _one_plus(_other((t1, t2), value))
    if one_plus is None or not isinstance(shift, Node) or shift is value:
        return None
    scale, view, factor_nodes = one_plus
    return Chain("addcmul", value, _with_tail([user]), scale, shift, factor_nodes, scale_view=view)


def match_norm_plus_scaled(value: Node, user: Node) -> Optional[Chain]:
    """``norm + norm * scale [+ shift]``: ``user`` adds ``value`` and ``value * scale``."""
    product = _other(binary_operands(user, "add"), value)
    scale = _other(binary_operands(product, "mul"), value)
    if not isinstance(scale, Node):
        return None
    return _finish("norm+norm*scale", value, [product, user], scale, [])


def match_unscaled(value: Node, user: Node) -> Optional[Chain]:
    """``norm * scale [+ shift]`` without ``1 +``: seen and reported, never fused (the op computes
    ``norm * (1 + scale)``; passing ``scale - 1`` would round differently)."""
    scale = _other(binary_operands(user, "mul"), value)
    if not isinstance(scale, Node) or _one_plus(scale) is not None:
        return None
    chain = _finish("norm*scale", value, [user], scale, [])
    chain.rejection = "multiplier is not `1 + scale` (the op computes norm * (1 + scale))"
    return chain


def modulates(chain: Chain, site: NormSite) -> bool:
    """Whether ``chain`` is a modulation of ``site``'s normalised tensor: its scale and shift are
    computed without it (conditioning such as a timestep embedding, a per-token table, parameters).

    A chain shape only says ``norm * a + b``; a modulation's ``a`` and ``b`` come from elsewhere. An
    op of the same shape whose terms read the normalised tensor itself is not one -- above all RoPE
    after a q/k norm, ``x * cos + rotate(x) * sin`` (diffusers' ``apply_rotary_emb``), whose added
    term is a permutation of ``x``: such a chain is not seen (not reported, not fused).
    """
    return not any(computed_from(operand, site.node) for operand in (chain.scale, chain.shift))


#: Matchers tried, in order, on each user of the normalised tensor.
MATCHERS: tuple[Callable[[Node, Node], Optional[Chain]], ...] = (
    match_norm_plus_scaled,
    match_mul_add,
    match_addcmul,
)
#: Tried only on users no matcher above claimed (so ``norm * scale`` inside ``norm + norm * scale``
#: is not mistaken for a chain of its own).
REPORT_ONLY_MATCHERS = (match_unscaled,)


# --- check ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What :func:`check` decided about a chain.

    Attributes:
        reason: why the chain is left alone; None when it is fused.
        layout: modulation layout(s) for the report, e.g. "per-sample" or "scale per-token, shift shared".
        x: the op's input: the norm's input before exact float32 upcasts.
        weight, bias: the affine parameters before exact float32 upcasts.
        absorbed: the upcast nodes passed to reach ``x``/``weight``/``bias`` (may die with the chain).
        eps: the eps the op gets.
        fake_outputs: the op's fake ``(y, *statistics)`` computed from the graph's fake values.
    """

    reason: Optional[str]
    layout: str = "?"
    x: Any = None
    weight: Any = None
    bias: Any = None
    absorbed: list[Node] = field(default_factory=list)
    eps: float = 0.0
    fake_outputs: Optional[tuple] = None


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name} (shape {static_dims(t.shape)}, dtype {str(t.dtype).replace('torch.', '')})"


def _layout_text(scale_layout: str, shift_layout: Optional[str]) -> str:
    if shift_layout is None:
        return f"{scale_layout}, no shift"
    if shift_layout == scale_layout:
        return scale_layout
    return f"scale {scale_layout}, shift {shift_layout}"


def _outside_user(chain: Chain) -> Optional[str]:
    inside = set(chain.nodes)
    for node in chain.nodes[:-1]:
        for user in node.users:
            if user not in inside:
                return f"intermediate `{node.name}` also feeds `{user.name}` outside the chain"
    return None


def _normalized_dims(shape: Any) -> Optional[list]:
    """The norm's normalized_shape as :func:`static_dims`, or None if it is not a constant list
    of sizes (sizes read from the graph, e.g. ``x.shape[-1:]`` under dynamic shapes, are fine)."""
    if not isinstance(shape, (list, tuple)):
        return None
    dims = []
    for d in shape:
        if isinstance(d, Node):
            d = d.meta.get("val", d.meta.get("example_value"))
        if not isinstance(d, (int, torch.SymInt)) or isinstance(d, bool):
            return None
        dims.append(d)
    return static_dims(dims)


def _param_value(operand: Any, fake_mode) -> Optional[torch.Tensor]:
    if isinstance(operand, ParamRef):
        return fake_mode.from_tensor(operand.tensor, static_shapes=True)
    return fake_value(operand)


def _strip(operand: Any, absorbed: list[Node]) -> Any:
    if not isinstance(operand, Node):
        return operand
    stripped, passed = strip_exact_casts(operand)
    absorbed.extend(passed)
    return stripped


def _signature(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return tuple(static_dims(t.shape)), tuple(static_dims(t.stride())), t.dtype, device_of(t)


def _fake_outputs(op, fake_mode, inputs: tuple, eps: float, final_val: torch.Tensor, cache: Optional[dict]) -> tuple:
    """The op's fake ``(y, *statistics)`` for these fake inputs.

    The op's fake kernel runs once per distinct input signature (shapes, strides, dtypes, devices,
    eps, out dtype) -- it validates the inputs and gives the outputs' metadata; a DiT's chains share
    a handful of signatures, and a fake dispatch costs ~0.2 ms. ``y`` is the replaced node's own fake
    value when it already has the metadata the kernel gives (the node disappears, so no two live
    nodes share it); the per-row statistics, which no node reads, are shared between chains of one
    signature.
    """
    key = (op, tuple(_signature(t) for t in inputs), eps, final_val.dtype)
    if cache is None or key not in cache:
        with fake_mode:
            outputs = op(*inputs, eps, final_val.dtype)
        if cache is None:
            return outputs
        cache[key] = outputs
    y, *stats = cache[key]
    if _signature(final_val) == _signature(y):
        y = final_val
    else:
        with fake_mode:
            y = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=y.device)
    return (y, *stats)


# --- the pattern of one norm→modulate op ---------------------------------------------------------

_META_KEYS = ("val", "example_value")
_FAMILY_NAMES = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}
_COPIED_META = ("stack_trace", "nn_module_stack")


@dataclass(frozen=True)
class NormModulatePattern:
    """The match / check / replace of one norm→modulate op (see ``adaptiveload.fxfuse.registry``).

    Attributes:
        name: the pattern's name (counters, report).
        family: the norms it starts from, :attr:`NormSite.family` ("layer_norm" or "rms_norm").
        op: the fused op, called as ``op(x, weight, [bias,] scale, shift, eps, out_dtype)`` and
            returning ``(y, *statistics)``.
        has_bias: whether the op takes the norm's bias.
    """

    name: str
    family: str
    op: Any
    has_bias: bool

    # --- match ---

    def match(self, gm: GraphModule, node: Node) -> Optional[Match]:
        """The chains that start from ``node``'s normalised tensor, when ``node`` is a norm of this
        pattern's family; the match's reason rejects them all when the normalised tensor is needed
        elsewhere or the graph has no fake values."""
        site = norm_site(gm, node)
        if site is None or site.family != self.family:
            return None
        chains, tree, outside = chains_of(site)
        if not chains:
            return None
        for chain in chains:
            chain.leftovers = [*chain.leftovers, *reversed(tree[1:])]
        reason = None
        if fake_value(site.output) is None:
            reason = NO_METADATA
        elif outside:
            reason = f"normalised tensor also feeds `{outside[0].name}` outside the chain"
        return Match(chains, reason)

    # --- check ---

    def check(self, chain: Chain, fake_cache: Optional[dict] = None) -> Verdict:
        """Decide whether ``chain`` may be replaced by the fused op, before anything is mutated.

        Rejects (with the reason): a norm that only looks like one (``NormSite.rejection``); a
        rejection fixed by the matcher; an intermediate node with a user outside the chain; missing
        fake values; a norm over more than the last dim; a computed eps; non-floating tensors;
        weight/bias not [D]; a modulation whose layout is not per-sample, per-token or shared over x
        (``modulation_layout``); a result whose shape or device is not x's; inputs the op's fake
        kernel refuses.

        ``fake_cache`` (a dict kept for one pass) lets chains with the same input signature share
        one run of the op's fake kernel (see :func:`_fake_outputs`).
        """
        site = chain.site
        for reason in (site.rejection, chain.rejection, _outside_user(chain)):
            if reason is not None:
                return Verdict(reason)
        absorbed: list[Node] = []
        x = _strip(site.input, absorbed)
        weight, bias = _strip(site.weight, absorbed), _strip(site.bias, absorbed)
        x_val, final_val = fake_value(x), fake_value(chain.final)
        # a (1 + scale)[:, None] factor: scale as the op will get it has the view's shape and dtype
        scale_val = fake_value(chain.scale if chain.scale_view is None else chain.scale_view)
        shift_val = fake_value(chain.shift)
        fake_mode = getattr(x_val, "fake_mode", None)
        if fake_mode is None or final_val is None or scale_val is None or (chain.shift is not None and shift_val is None):
            return Verdict(NO_METADATA)
        weight_val, bias_val = _param_value(weight, fake_mode), _param_value(bias, fake_mode)
        verdict = Verdict(None, x=x, weight=weight, bias=bias, absorbed=absorbed)
        verdict.reason = self._norm_reason(site, x_val, weight_val, bias_val, verdict)
        if verdict.reason is not None:
            return verdict
        x_dims = static_dims(x_val.shape)
        layouts = {}
        for name, val in (("scale", scale_val), ("shift", shift_val)):
            if val is None:
                continue
            if not is_floating(val):
                verdict.reason = f"{_describe(name, val)} is not floating point"
                return verdict
            try:
                layouts[name] = modulation_layout(static_dims(val.shape), x_dims)
            except ValueError as err:
                verdict.reason = f"{name}: {err}"
                return verdict
        verdict.layout = _layout_text(layouts["scale"], layouts.get("shift"))
        if not is_floating(final_val) or static_dims(final_val.shape) != x_dims:
            verdict.reason = f"result {_describe('y', final_val)} does not have the shape of {_describe('x', x_val)}"
            return verdict
        devices = {device_of(t) for t in (x_val, final_val, scale_val, shift_val, weight_val, bias_val) if t is not None}
        if len(devices) != 1:
            verdict.reason = f"tensors on several devices {sorted(map(str, devices))}"
            return verdict
        try:
            verdict.fake_outputs = _fake_outputs(
                self.op, fake_mode, self._tensor_args(x_val, weight_val, bias_val, scale_val, shift_val),
                verdict.eps, final_val, fake_cache)
        except (ValueError, RuntimeError) as err:
            verdict.reason = f"the fused op rejects the inputs: {err}"
        return verdict

    def _norm_reason(self, site: NormSite, x_val, weight_val, bias_val, verdict: Verdict) -> Optional[str]:
        """Why the norm itself cannot be the op's (None if it can); sets ``verdict.eps``."""
        x_dims, norm = static_dims(x_val.shape), _FAMILY_NAMES[site.family]
        if not is_floating(x_val) or len(x_dims) < 2:
            return f"input {_describe('x', x_val)} is not a floating tensor of at least 2 dims"
        norm_dims = _normalized_dims(site.normalized_shape)
        if norm_dims is None:
            return "normalized_shape is computed in the graph"
        if len(norm_dims) != 1 or norm_dims[0] != x_dims[-1]:
            return f"{norm} over the last {len(norm_dims)} dims {norm_dims}, not only the last of x {x_dims}"
        eps = site.eps
        if eps is None and site.family == "rms_norm":  # F.rms_norm's default, from the dtype it normalised
            eps = rms_norm_default_eps(fake_value(site.input).dtype)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return "eps is computed in the graph"
        verdict.eps = float(eps)
        if bias_val is not None and not self.has_bias:
            return f"{norm} has a bias, which {self.name} does not take"
        for name, val in (("weight", weight_val), ("bias", bias_val)):
            if val is not None and (not is_floating(val) or static_dims(val.shape) != x_dims[-1:]):
                return f"{norm} {_describe(name, val)} is not a floating [{x_dims[-1]}] tensor"
        return None

    def _tensor_args(self, x, weight, bias, scale, shift) -> tuple:
        return (x, weight, bias, scale, shift) if self.has_bias else (x, weight, scale, shift)

    # --- replace ---

    def replace(self, gm: GraphModule, chain: Chain, verdict: Verdict, replaced: dict[Node, Node]) -> Node:
        """Replace ``chain.final`` by ``getitem(op(...), 0)`` and erase what that orphaned.

        ``replaced`` maps final nodes already replaced in this graph to their replacement (a chain's
        input may be an earlier chain's final node); it is updated. Returns the new getitem node.
        """
        graph, final = gm.graph, chain.final
        site, (y_val, *stat_vals) = chain.site, verdict.fake_outputs
        fake_mode = fake_value(final).fake_mode

        def operand(value: Any, as_written: Any = None) -> Any:
            if isinstance(value, ParamRef):
                node = graph.get_attr(value.qualname)
                node.meta["val"] = fake_mode.from_tensor(value.tensor, static_shapes=True)
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
                _set_fake_value(scale, _fake_eval(scale, fake_mode))
            args = self._tensor_args(operand(verdict.x, site.input), operand(verdict.weight, site.weight),
                                     operand(verdict.bias, site.bias), scale, operand(chain.shift))
            fused = graph.call_function(self.op, (*args, verdict.eps, fake_value(final).dtype))
            out = graph.call_function(operator.getitem, (fused, 0))
        for key in _META_KEYS:
            if key in final.meta:
                fused.meta[key] = (y_val, *stat_vals)
                out.meta[key] = y_val
        if "tensor_meta" in final.meta:
            from torch.fx.passes.shape_prop import _extract_tensor_metadata

            out.meta["tensor_meta"] = _extract_tensor_metadata(y_val)
        for key in _COPIED_META:
            if key in final.meta:
                fused.meta[key] = out.meta[key] = final.meta[key]

        final.replace_all_uses_with(out)
        replaced[final] = out
        dead = [*chain.nodes, *chain.leftovers, site.output, *site.node.users, site.node, *site.internal,
                *verdict.absorbed]
        _erase_unused(graph, dead)
        return out


def chains_of(site: NormSite) -> tuple[list[Chain], list[Node], list[Node]]:
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


def _erase_unused(graph: torch.fx.Graph, candidates: list) -> None:
    """Erase each candidate node of ``graph`` that no longer has users (latest first, so that a node
    whose only users are candidates goes too); nothing else."""
    nodes = {n for n in candidates if isinstance(n, Node) and n.graph is graph}
    for node in sorted(nodes, reverse=True):
        if not node.users and not node._erased and node.op not in ("placeholder", "output", "get_attr"):
            graph.erase_node(node)
