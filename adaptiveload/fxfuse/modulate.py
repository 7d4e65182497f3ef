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
word). Modulation gathered to a pack's tokens from one row per sample (``m[segment_ids]``, or
``m.repeat_interleave(lengths, dim=0, output_size=T)``; :func:`segmented_modulation`) goes to the
op's segmented layout, which keeps no per-token copy of it.

The residual patterns (:mod:`adaptiveload.fxfuse.residual`) match a norm site the same way and reuse
these pieces: :func:`site_chains` (match), :meth:`NormModulatePattern.check_chain` (the norm and
modulation rules), :func:`fake_outputs`, :func:`norm_operands` and :func:`call_fused` (replace).
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
    last_dim_piece,
    narrows,
    norm_site,
    one_plus_operand,
    rms_norm_default_eps,
    row_gather,
    row_repeat,
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
        scale, shift: the graph's modulation nodes (shift None for a scale-only chain; both None for
            a plain norm, :func:`plain_norm_chain`, which only the residual patterns fuse).
        scale_view: for ``(1 + scale)[:, None]`` (diffusers' AdaLayerNormContinuous), the view node
            of ``1 + scale``; the rewrite applies the same view to ``scale``.
        leftovers: nodes the chain reads that may die with it but may also be shared (``1 + scale``).
        rejection: a reason fixed by the pattern itself (the chain can never be fused).
        site: the norm the chain starts from (set by the caller).
    """

    variant: str
    value: Node
    nodes: list[Node]
    scale: Optional[Node]
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
    segmented: Optional["Segmented"] = None


def describe_fake(name: str, t: torch.Tensor) -> str:
    """``"name (shape [..], dtype ..)"`` of a fake value, for reasons (symbolic sizes as expressions)."""
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


def fake_outputs(op, fake_mode, inputs: tuple, scalars: tuple, finals: tuple, cache: Optional[dict]) -> tuple:
    """The op's fake outputs for these fake tensor ``inputs`` and trailing ``scalars``.

    The op's fake kernel runs once per distinct input signature (shapes, strides, dtypes, devices,
    scalars) -- it validates the inputs and gives the outputs' metadata; a DiT's chains share a
    handful of signatures, and a fake dispatch costs ~0.2 ms. Output i < len(finals) replaces the
    node whose fake value is ``finals[i]``: it is that value itself when it already has the metadata
    the kernel gives (the node disappears, so no two live nodes share it); the other outputs (per-row
    statistics, which no node reads) are shared between chains of one signature.
    """
    key = (op, tuple(_signature(t) for t in inputs), scalars)
    if cache is None or key not in cache:
        with fake_mode:
            outputs = op(*inputs, *scalars)
        if cache is None:
            cache = {}
        cache[key] = outputs
    outputs = list(cache[key])
    for i, final_val in enumerate(finals):
        out = outputs[i]
        if _signature(final_val) == _signature(out):
            outputs[i] = final_val
        else:
            with fake_mode:
                outputs[i] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    return tuple(outputs)


# --- segmented modulation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Repeats:
    """The segment ids a ``repeat_interleave`` of rows implies: ``torch.repeat_interleave(repeats,
    output_size=output_size)`` (a node the rewrite inserts)."""

    repeats: Node
    output_size: Any


@dataclass(frozen=True)
class Piece:
    """Piece ``index`` of ``rows.chunk(chunks, dim=-1)``: the per-segment rows of one modulation
    tensor when the graph gathered all of them before splitting (``m[ids].chunk(6, -1)[i]``); the
    rewrite inserts the chunk of the [n, chunks * D] rows (a strided view, no copy)."""

    rows: Node
    chunks: int
    index: int


@dataclass
class Segmented:
    """Modulation gathered to the tokens from one row per segment (a pack's samples):
    ``scale = m_scale[segment_ids]`` or ``m_scale.repeat_interleave(lengths, dim=0, output_size=T)``
    (and the shift, a residual's gate alike; also a piece of such a gather split along features),
    x [1, T, D] or [T, D].

    Attributes:
        rows: the per-segment rows [n, D] each present modulation tensor ("gate", "scale", "shift")
            is gathered from: a node, or a :class:`Piece` of one.
        segment_ids: the 1-D integer node the gathers index with, or the :class:`Repeats` they
            repeat by.
        nodes: the gathers, splits and views, which die with the chain unless used elsewhere.
        ids_val, values: the fake values of the segment ids and of the rows, by name (set by the check).
    """

    rows: dict
    segment_ids: Any
    nodes: list[Node]
    ids_val: Any = None
    values: dict = field(default_factory=dict)

    def plan(self, fake_mode) -> None:
        """Set :attr:`ids_val` and :attr:`values`."""
        self.ids_val = _segment_ids_value(self, fake_mode)
        self.values = {name: _source_value(src, fake_mode) for name, src in self.rows.items()}

    def graph_nodes(self, graph: torch.fx.Graph, replaced: dict[Node, Node]) -> tuple[dict, Node]:
        """``(rows by name, segment ids)`` as graph nodes at the insertion point (inserting the
        chunk pieces and the ids of repeats)."""
        rows = {name: _source_node(graph, src, self.values[name], replaced) for name, src in self.rows.items()}
        return rows, _segment_ids_node(graph, self, replaced)


def _rows_of(node: Any) -> Optional[tuple[Node, Any]]:
    """``(src, ids)`` of a gather (ids a node) or a row repeat (ids a :class:`Repeats`) of src."""
    found = row_gather(node)
    if found is not None:
        return found
    repeated = row_repeat(node)
    return None if repeated is None else (repeated[0], Repeats(*repeated[1:]))


def _gathered(mod: Node, x_dims: list) -> Optional[tuple[Any, Any, list[Node]]]:
    """``(src, ids, nodes)`` when ``mod`` (as the chain reads it, of x's shape) is ``src[ids]`` or a
    ``repeat_interleave`` of src's rows, with leading 1-dims added or not (``[None]``,
    ``.unsqueeze(0)``) for x [1, T, D], or a piece of such a gather split along the features
    (``m[ids].chunk(k, -1)[i]``, src then a :class:`Piece`)."""
    nodes, node, piece = [mod], mod, None
    found = _rows_of(node)
    while found is None:  # views (leading 1-dims) and at most one split, back to the gather
        split = last_dim_piece(node) if piece is None else None
        if split is not None:
            piece = split
            nodes.append(node.args[0])  # the chunk call
            node = split[0]
        else:
            node = view_source(node)
            if node is None:
                return None
        nodes.append(node)
        found = _rows_of(node)
    gather_dims = static_dims(fake_value(node).shape)
    if piece is not None:
        gather_dims[-1] //= piece[1]
        found = (Piece(found[0], piece[1], piece[2]), found[1])
    mod_dims = static_dims(fake_value(mod).shape)
    while len(mod_dims) > 2 and mod_dims[0] == 1:
        mod_dims = mod_dims[1:]
    # the gather and what the chain reads both one row per token, as x (x [1, T, D] or [T, D])
    if not (x_dims[-2:] == gather_dims == mod_dims) or any(d != 1 for d in x_dims[:-2]):
        return None
    return (*found, nodes)


def _row_count(src: Any) -> Any:
    return static_dims(fake_value(src.rows if isinstance(src, Piece) else src).shape)[0]


def segmented_rows(mods: dict, x_dims: list) -> Optional[Segmented]:
    """The modulation tensors ``mods`` (name -> node or None) as per-segment rows, when every given
    one is a gather by one segment_ids node (:func:`~adaptiveload.fxfuse.nodes.row_gather`) or a
    repeat by one counts node with one output size (:func:`~adaptiveload.fxfuse.nodes.row_repeat`),
    to x's shape ``x_dims`` (x [1, T, D] or [T, D]), from tensors of one number of rows; None
    otherwise (then the gathered tensors are per-token modulation), and None when none is given."""
    found = {name: _gathered(mod, x_dims) for name, mod in mods.items() if mod is not None}
    if not found or any(f is None for f in found.values()):
        return None
    first = next(iter(found.values()))
    if any(not _same_ids(f[1], first[1]) or _row_count(f[0]) != _row_count(first[0]) for f in found.values()):
        return None
    return Segmented({name: f[0] for name, f in found.items()}, first[1], [n for f in found.values() for n in f[2]])


def segmented_modulation(chain: Chain, x_dims: list) -> Optional[Segmented]:
    """:func:`segmented_rows` of the chain's scale and shift (None for a chain without scale or with
    a ``(1 + scale)[:, None]`` view)."""
    if chain.scale is None or chain.scale_view is not None:
        return None
    return segmented_rows({"scale": chain.scale, "shift": chain.shift}, x_dims)


def _same_ids(a: Any, b: Any) -> bool:
    if isinstance(a, Repeats) and isinstance(b, Repeats):
        return a.repeats is b.repeats and (a.output_size is b.output_size or a.output_size == b.output_size)
    return a is b


def _source_value(src: Any, fake_mode) -> Any:
    """The fake value of per-segment rows: the node's, or its :class:`Piece`."""
    if not isinstance(src, Piece):
        return fake_value(src)
    with fake_mode:
        return fake_value(src.rows).chunk(src.chunks, dim=-1)[src.index]


def _source_node(graph: torch.fx.Graph, src: Any, value: Any, replaced: dict[Node, Node]) -> Any:
    """The graph node of per-segment rows at the insertion point (a chunk and its piece inserted
    for a :class:`Piece`, with fake value ``value``)."""
    if not isinstance(src, Piece):
        return graph_value(src, replaced)
    split = graph.call_method("chunk", (graph_value(src.rows, replaced), src.chunks), {"dim": -1})
    node = graph.call_function(operator.getitem, (split, src.index))
    _copy_fake_keys(src.rows, node, value)
    return node


def _segment_ids_value(seg: Segmented, fake_mode) -> Any:
    """The fake value of the segment ids: the gathers' index, or what the repeats imply."""
    if not isinstance(seg.segment_ids, Repeats):
        return fake_value(seg.segment_ids)
    size = seg.segment_ids.output_size
    if isinstance(size, Node):
        size = size.meta.get("val", size.meta.get("example_value"))
    with fake_mode:
        return torch.repeat_interleave(fake_value(seg.segment_ids.repeats), output_size=size)


def _segment_ids_node(graph: torch.fx.Graph, seg: Segmented, replaced: dict[Node, Node]) -> Node:
    """The graph node of the segment ids at the insertion point (inserted for repeats)."""
    if not isinstance(seg.segment_ids, Repeats):
        return graph_value(seg.segment_ids, replaced)
    node = graph.call_function(torch.repeat_interleave, (graph_value(seg.segment_ids.repeats, replaced),),
                               {"output_size": seg.segment_ids.output_size})
    _copy_fake_keys(seg.segment_ids.repeats, node, seg.ids_val)
    return node


def _copy_fake_keys(like: Node, node: Node, value: Any) -> None:
    """``value`` as ``node``'s fake value, under the metadata keys ``like`` uses."""
    for key in _META_KEYS:
        if key in like.meta:
            node.meta[key] = value


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
        segmented_op: the op's segmented layout, called as ``segmented_op(x, weight, [bias,]
            scale, shift, segment_ids, eps, out_dtype)`` with per-segment scale and shift [n, D],
            for chains whose modulation is gathered to the tokens (:func:`segmented_modulation`).
    """

    name: str
    family: str
    op: Any
    has_bias: bool
    segmented_op: Any = None

    # --- match ---

    def match(self, gm: GraphModule, node: Node) -> Optional[Match]:
        """The chains that start from ``node``'s normalised tensor, when ``node`` is a norm of this
        pattern's family; the match's reason rejects them all when the normalised tensor is needed
        elsewhere or the graph has no fake values."""
        site = norm_site(gm, node)
        if site is None or site.family != self.family:
            return None
        chains, reason = site_chains(site)
        return Match(chains, reason) if chains else None

    # --- check ---

    def check(self, chain: Chain, fake_cache: Optional[dict] = None) -> Verdict:
        """Decide whether ``chain`` may be replaced by the fused op, before anything is mutated.

        Rejects (with the reason): what :meth:`check_chain` rejects, and inputs the op's fake
        kernel refuses.

        ``fake_cache`` (a dict kept for one pass) lets chains with the same input signature share
        one run of the op's fake kernel (see :func:`fake_outputs`).
        """
        verdict, values = self.check_chain(chain)
        if verdict.reason is not None:
            return verdict
        if self._check_segmented(chain, verdict, values, fake_cache):
            return verdict
        inputs = self.tensor_args(values.x, values.weight, values.bias, values.scale, values.shift)
        try:
            verdict.fake_outputs = fake_outputs(self.op, values.fake_mode, inputs, (verdict.eps, values.final.dtype),
                                                (values.final,), fake_cache)
        except (ValueError, RuntimeError) as err:
            verdict.reason = f"the fused op rejects the inputs: {err}"
        return verdict

    def _check_segmented(self, chain: Chain, verdict: Verdict, values: "ChainValues",
                         fake_cache: Optional[dict]) -> bool:
        """Plan the segmented op for a chain whose modulation is gathered per segment (sets
        ``verdict.segmented``, its layout and fake outputs; True). False when the chain's modulation
        is not such a gather or the segmented op refuses it: the chain then passes its per-token
        modulation to the plain op."""
        if self.segmented_op is None:
            return False
        seg = segmented_modulation(chain, static_dims(values.x.shape))
        if seg is None:
            return False
        seg.plan(values.fake_mode)
        inputs = (*self.tensor_args(values.x, values.weight, values.bias, seg.values["scale"],
                                    seg.values.get("shift")), seg.ids_val)
        try:
            verdict.fake_outputs = fake_outputs(self.segmented_op, values.fake_mode, inputs,
                                                (verdict.eps, values.final.dtype), (values.final,), fake_cache)
        except (ValueError, RuntimeError):
            return False
        verdict.segmented = seg
        verdict.layout = "segmented" if "shift" in seg.rows else "segmented, no shift"
        return True

    def check_chain(self, chain: Chain) -> tuple[Verdict, Optional["ChainValues"]]:
        """Every rule of :meth:`check` but the op's fake kernel, and the fake values it read.

        Rejects (with the reason): a norm that only looks like one (``NormSite.rejection``); a
        rejection fixed by the matcher; an intermediate node with a user outside the chain; missing
        fake values; a norm over more than the last dim; a computed eps; non-floating tensors;
        weight/bias not [D]; a modulation whose layout is not per-sample, per-token or shared over x
        (``modulation_layout``); a result whose shape or device is not x's. A chain without scale
        (:func:`plain_norm_chain`) has the layout "no modulation".

        Returns:
            ``(verdict, values)``: ``values`` None when the verdict rejects the chain.
        """
        site = chain.site
        for reason in (site.rejection, chain.rejection, _outside_user(chain)):
            if reason is not None:
                return Verdict(reason), None
        absorbed: list[Node] = []
        x = _strip(site.input, absorbed)
        weight, bias = _strip(site.weight, absorbed), _strip(site.bias, absorbed)
        x_val, final_val = fake_value(x), fake_value(chain.final)
        # a (1 + scale)[:, None] factor: scale as the op will get it has the view's shape and dtype
        scale_val = fake_value(chain.scale if chain.scale_view is None else chain.scale_view)
        shift_val = fake_value(chain.shift)
        fake_mode = getattr(x_val, "fake_mode", None)
        if (fake_mode is None or final_val is None or (chain.scale is not None and scale_val is None)
                or (chain.shift is not None and shift_val is None)):
            return Verdict(NO_METADATA), None
        weight_val, bias_val = _param_value(weight, fake_mode), _param_value(bias, fake_mode)
        verdict = Verdict(None, x=x, weight=weight, bias=bias, absorbed=absorbed)
        verdict.reason = self._norm_reason(site, x_val, weight_val, bias_val, verdict)
        if verdict.reason is not None:
            return verdict, None
        x_dims = static_dims(x_val.shape)
        layouts = {}
        for name, val in (("scale", scale_val), ("shift", shift_val)):
            if val is None:
                continue
            verdict.reason = _mod_reason(name, val, x_dims, layouts)
            if verdict.reason is not None:
                return verdict, None
        verdict.layout = _layout_text(layouts["scale"], layouts.get("shift")) if layouts else "no modulation"
        if not is_floating(final_val) or static_dims(final_val.shape) != x_dims:
            verdict.reason = (f"result {describe_fake('y', final_val)} does not have the shape of "
                              f"{describe_fake('x', x_val)}")
            return verdict, None
        devices = {device_of(t) for t in (x_val, final_val, scale_val, shift_val, weight_val, bias_val)
                   if t is not None}
        if len(devices) != 1:
            verdict.reason = f"tensors on several devices {sorted(map(str, devices))}"
            return verdict, None
        return verdict, ChainValues(fake_mode, x_val, weight_val, bias_val, scale_val, shift_val, final_val)

    def _norm_reason(self, site: NormSite, x_val, weight_val, bias_val, verdict: Verdict) -> Optional[str]:
        """Why the norm itself cannot be the op's (None if it can); sets ``verdict.eps``."""
        x_dims, norm = static_dims(x_val.shape), _FAMILY_NAMES[site.family]
        if not is_floating(x_val) or len(x_dims) < 2:
            return f"input {describe_fake('x', x_val)} is not a floating tensor of at least 2 dims"
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
                return f"{norm} {describe_fake(name, val)} is not a floating [{x_dims[-1]}] tensor"
        return None

    def tensor_args(self, x, weight, bias, scale, shift) -> tuple:
        """The op's tensor arguments in its order: the bias only if the op takes one."""
        return (x, weight, bias, scale, shift) if self.has_bias else (x, weight, scale, shift)

    # --- replace ---

    def replace(self, gm: GraphModule, chain: Chain, verdict: Verdict, replaced: dict[Node, Node]) -> Node:
        """Replace ``chain.final`` by ``getitem(op(...), 0)`` and erase what that orphaned.

        ``replaced`` maps final nodes already replaced in this graph to their replacement (a chain's
        input may be an earlier chain's final node); it is updated. Returns the new getitem node.
        """
        graph, final, site, seg = gm.graph, chain.final, chain.site, verdict.segmented
        with graph.inserting_before(final):
            x, weight, bias, scale, shift = norm_operands(graph, chain, verdict, replaced)
            op, tensors = self.op, self.tensor_args(x, weight, bias, scale, shift)
            if seg is not None:
                op = self.segmented_op
                rows, ids = seg.graph_nodes(graph, replaced)
                tensors = (*self.tensor_args(x, weight, bias, rows["scale"], rows.get("shift")), ids)
            args = (*tensors, verdict.eps, fake_value(final).dtype)
            (out,) = call_fused(graph, op, args, verdict.fake_outputs, (final,), replaced)
        dead = [*chain.nodes, *chain.leftovers, site.output, *site.node.users, site.node, *site.internal,
                *verdict.absorbed, *(seg.nodes if seg is not None else ())]
        erase_unused(graph, dead)
        return out


@dataclass
class ChainValues:
    """The fake values :meth:`NormModulatePattern.check_chain` read: the op's tensor inputs as it will
    get them (None for absent ones), the final node's value, and their fake mode."""

    fake_mode: Any
    x: torch.Tensor
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    shift: Optional[torch.Tensor]
    final: torch.Tensor


def _mod_reason(name: str, val: torch.Tensor, x_dims: list, layouts: dict) -> Optional[str]:
    """Why the modulation tensor ``val`` cannot be passed to the op for x of ``x_dims`` (None if it
    can: ``layouts[name]`` gets its layout)."""
    if not is_floating(val):
        return f"{describe_fake(name, val)} is not floating point"
    try:
        layouts[name] = modulation_layout(static_dims(val.shape), x_dims)
    except ValueError as err:
        return f"{name}: {err}"
    return None


def site_chains(site: NormSite) -> tuple[list[Chain], Optional[str]]:
    """The chains starting from ``site``'s normalised tensor (:func:`chains_of`; the norm tree's casts
    join each chain's leftovers) and the reason that rejects them all: the normalised tensor also
    feeds a node outside every chain, or the graph has no fake values (None if neither)."""
    chains, tree, outside = chains_of(site)
    for chain in chains:
        chain.leftovers = [*chain.leftovers, *reversed(tree[1:])]
    reason = None
    if fake_value(site.output) is None:
        reason = NO_METADATA
    elif outside:
        reason = f"normalised tensor also feeds `{outside[0].name}` outside the chain"
    return chains, reason


def plain_norm_chain(site: NormSite) -> Chain:
    """The "chain" of a norm without modulation: its output and the dtype casts after it that the
    op takes in (as :func:`_with_tail` takes them), the last one the final node; every user of that
    node reads the op's output. Fused only behind a residual prologue (Wan's cross-attention
    ``norm2``)."""
    return Chain("norm", site.output, _with_tail([site.output]), None, None, site=site)


def norm_operands(graph: torch.fx.Graph, chain: Chain, verdict: Verdict, replaced: dict[Node, Node]) -> tuple:
    """The graph nodes to pass as the op's ``(x, weight, bias, scale, shift)`` (None for absent ones),
    created at the graph's current insertion point where needed: a ``get_attr`` for a module's
    parameter, and ``scale`` under the chain's view when the graph wrote ``(1 + scale)[:, None]``.
    A node already replaced (``replaced``) is passed as its replacement."""
    site = chain.site
    fake_mode = fake_value(chain.final).fake_mode

    def operand(value: Any, as_written: Any = None) -> Any:
        if isinstance(value, ParamRef):
            node = graph.get_attr(value.qualname)
            node.meta["val"] = fake_mode.from_tensor(value.tensor, static_shapes=True)
            return node
        if isinstance(value, Node) and value._erased:
            # the upcasts stripped from x led into a chain rewritten before: use the cast's result,
            # i.e. that chain's replacement (the same values the norm read)
            value = as_written
        return graph_value(value, replaced)

    scale = operand(chain.scale)
    if chain.scale_view is not None:  # (1 + scale)[:, None]: the same view, of scale
        one_plus, scale_source = chain.scale_view.args[0], scale
        scale = graph.node_copy(chain.scale_view, lambda n: scale_source if n is one_plus else n)
        _set_fake_value(scale, _fake_eval(scale, fake_mode))
    return (operand(verdict.x, site.input), operand(verdict.weight, site.weight), operand(verdict.bias, site.bias),
            scale, operand(chain.shift))


def graph_value(value: Any, replaced: dict[Node, Node]) -> Any:
    """``value``, or the node that replaced it (``replaced``, followed to its end)."""
    while value in replaced:
        value = replaced[value]
    return value


def call_fused(graph: torch.fx.Graph, op: Any, args: tuple, outputs: tuple, finals: tuple,
               replaced: dict[Node, Node]) -> list[Node]:
    """Insert ``op(*args)`` and one ``getitem(op, i)`` per node of ``finals`` at the graph's insertion
    point; the uses of ``finals[i]`` go to the i-th getitem (``replaced`` records it). ``outputs``
    are the op's fake outputs; the call and the getitems get them, and the stack trace and module
    stack of the last final node. Returns the getitem nodes."""
    fused = graph.call_function(op, args)
    outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(finals))]
    last = finals[-1]
    for key in _META_KEYS:
        if key in last.meta:
            fused.meta[key] = tuple(outputs)
            for i, out in enumerate(outs):
                out.meta[key] = outputs[i]
    if "tensor_meta" in last.meta:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        for i, out in enumerate(outs):
            out.meta["tensor_meta"] = _extract_tensor_metadata(outputs[i])
    for key in _COPIED_META:
        if key in last.meta:
            for node in (fused, *outs):
                node.meta[key] = last.meta[key]
    for final, out in zip(finals, outs):
        final.replace_all_uses_with(out)
        replaced[final] = out
    return outs


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


def erase_unused(graph: torch.fx.Graph, candidates: list) -> None:
    """Erase each candidate node of ``graph`` that no longer has users (latest first, so that a node
    whose only users are candidates goes too); nothing else."""
    nodes = {n for n in candidates if isinstance(n, Node) and n.graph is graph}
    for node in sorted(nodes, reverse=True):
        if not node.users and not node._erased and node.op not in ("placeholder", "output", "get_attr"):
            graph.erase_node(node)
