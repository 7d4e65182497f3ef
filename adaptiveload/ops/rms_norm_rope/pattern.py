"""The FX pattern ``rms_norm_rope``: an RMSNorm across heads whose output is split into heads and
rotated pair by pair, as diffusers' Wan attention writes it (``WanAttnProcessor``)::

    q = attn.norm_q(q)                                  # any RMSNorm form norm_site finds
    q = q.unflatten(2, (attn.heads, -1))                # the last dim into heads
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)        # apply_rotary_emb
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(q)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    q = out.type_as(q)

or as adaptiveload's own Wan model writes the rotation (``adaptiveload.models.rope.apply_rope``: an
optional cast, ``torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)``, an
optional cast back), rewritten into ``rms_norm_rope(x, weight, cos, sin, heads, eps, out_dtype)`` (the
products and sums in either operand order), on the device types of :data:`~adaptiveload.ops.rms_norm_rope.op.FUSED_DEVICES`
(elsewhere the site is left as written, recorded as deferred). Where the norm's output or the split heads are also read elsewhere the site is
left alone, with the reason; a norm with no such rotation behind it is not this pattern's (it falls
through to ``rms_norm_modulate``). Registered with the fusion pass on import."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from adaptiveload.fxfuse.modulate import NO_METADATA, Verdict, call_fused, describe_fake, erase_unused, fake_outputs
from adaptiveload.fxfuse.nodes import (NormSite, ParamRef, binary_operands, device_of, fake_value, norm_site,
                                       rms_norm_default_eps, static_dims)
from adaptiveload.fxfuse.registry import Match, register_pattern
from adaptiveload.ops.rms_norm_rope.op import FUSED_DEVICES, rms_norm_rope

VARIANT = "rms_norm->heads->rope(empty_like, setitem even/odd)"
VARIANT_STACK = "rms_norm->heads->rope(stack even/odd, flatten)"
_EVEN, _ODD = (Ellipsis, slice(0, None, 2)), (Ellipsis, slice(1, None, 2))


@dataclass
class RopeSite:
    """A candidate: the norm, the split into heads, the rotation's nodes and its cos / sin operands.

    Attributes:
        site: the RMSNorm (:class:`NormSite`).
        heads: the number of heads of the split.
        cos, sin: the graph values the rotation multiplies by (each pair's cosine and sine).
        nodes: the split and rotation nodes in graph order, the last one the final node (its value
            the op replaces).
        reason: set when the structure matched but a value is also read outside it.
    """

    site: NormSite
    heads: int
    cos: Node
    sin: Node
    nodes: list[Node] = field(default_factory=list)
    reason: Optional[str] = None
    variant: str = VARIANT

    @property
    def anchor(self) -> Node:
        return self.site.node

    @property
    def final(self) -> Node:
        return self.nodes[-1]

    @property
    def norm(self) -> str:
        return self.site.kind

    @property
    def affine(self) -> bool:
        return self.site.weight is not None


def _method_or_function(node: Any, method: str, function: Any) -> bool:
    return isinstance(node, Node) and (
        (node.op == "call_method" and node.target == method)
        or (node.op == "call_function" and node.target is function))


def _heads_split(node: Node) -> Optional[int]:
    """The heads of ``node`` when it is ``t.unflatten(last, (heads, -1))`` (or ``(heads, head_dim)``)."""
    if not _method_or_function(node, "unflatten", torch.unflatten) or len(node.args) < 3:
        return None
    t, dim, sizes = node.args[:3]
    val = fake_value(t)
    if val is None or not isinstance(dim, int) or dim not in (-1, val.dim() - 1):
        return None
    if not isinstance(sizes, (tuple, list)) or len(sizes) != 2 or not isinstance(sizes[0], int):
        return None
    return sizes[0] if sizes[0] > 0 else None


def _single_user(node: Node, test) -> Optional[Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 and test(users[0]) else None


def _product(node: Any) -> Optional[tuple[Any, Any]]:
    return binary_operands(node, "mul")


def _is_product_of(node: Any, a: Node, b: Node) -> bool:
    ops = _product(node)
    return ops is not None and set(map(id, ops)) == {id(a), id(b)} and len(node.users) == 1


def _halves(pair: Node) -> Optional[tuple[Node, Node, Node]]:
    """``(unbind, x1, x2)`` of ``pair = t.unflatten(-1, (-1, 2))``: its single ``unbind(-1)`` and the two
    halves read from it; None for anything else."""
    unbind = _single_user(pair, lambda u: _method_or_function(u, "unbind", torch.unbind) and tuple(u.args[1:]) == (-1,))
    if unbind is None:
        return None
    halves = {u.args[1]: u for u in unbind.users if u.op == "call_function" and u.target is operator.getitem}
    if set(halves) != {0, 1} or len(unbind.users) != 2:
        return None
    return unbind, halves[0], halves[1]


def _is_pair_split(node: Node) -> bool:
    return _method_or_function(node, "unflatten", torch.unflatten) and tuple(node.args[1:3]) == (-1, (-1, 2))


def _rotated(x1: Node, x2: Node, even: Any, odd: Any) -> Optional[tuple[Node, Node, list[Node]]]:
    """``(cos, sin, nodes)`` where ``even = x1 * cos - x2 * sin`` and ``odd = x1 * sin + x2 * cos`` (the
    products and the sum in either operand order, each product read once); None otherwise."""
    sub, add = binary_operands(even, "sub"), binary_operands(odd, "add")
    if sub is None or add is None or not all(isinstance(v, Node) for v in (*sub, *add)):
        return None
    x1c, x2s = sub  # x1 * cos - x2 * sin
    factors = {}
    for prod, mine in ((x1c, x1), (x2s, x2)):
        ops = _product(prod)
        if ops is None or mine not in ops or len(prod.users) != 1:
            return None
        factors[prod] = ops[1] if ops[0] is mine else ops[0]
    cos, sin = factors[x1c], factors[x2s]
    a, b = add  # x1 * sin + x2 * cos, either order
    if not ((_is_product_of(a, x1, sin) and _is_product_of(b, x2, cos))
            or (_is_product_of(a, x2, cos) and _is_product_of(b, x1, sin))):
        return None
    return cos, sin, [x1c, x2s, even, a, b, odd]


def _rotation_setitem(split: Node) -> Optional[tuple[Node, Node, list[Node]]]:
    """``(cos, sin, nodes)`` of diffusers' ``apply_rotary_emb`` on ``split`` (module doc), the nodes
    with the final one last; None where the users of ``split`` are anything else."""
    pair = empty = final = None  # (other users of split: the match's reason)
    for user in split.users:
        if _is_pair_split(user):
            pair = user if pair is None else pair
        elif (user.op == "call_function" and user.target is torch.empty_like and user.args == (split,)
              and not user.kwargs):  # (a dtype= or memory_format= of its own is another computation)
            empty = user if empty is None else empty
        elif _method_or_function(user, "type_as", None) and user.args[1:] == (split,):
            final = user if final is None else final
    found = _halves(pair) if pair is not None and empty is not None else None
    if found is None:
        return None
    unbind, x1, x2 = found
    if final is None or final.args[0] is not empty:
        return None  # the rotated tensor is read from `empty` itself: not the form written above
    stores = [None, None]  # the setitems of the even and the odd positions
    for user in empty.users:
        if user.op == "call_function" and user.target is operator.setitem and user.args[0] is empty:
            if user.args[1] not in (_EVEN, _ODD):  # (slices compare by value; they are not hashable)
                return None
            stores[0 if user.args[1] == _EVEN else 1] = user
        elif user is not final:
            return None
    if None in stores or len(empty.users) != 3:
        return None
    rotated = _rotated(x1, x2, stores[0].args[2], stores[1].args[2])
    if rotated is None:
        return None
    cos, sin, math = rotated
    return cos, sin, [split, pair, unbind, x1, x2, *math, empty, *stores, final]


def _cast(node: Any) -> bool:
    """``t.to(dtype)`` / ``t.float()``: a dtype cast and nothing else."""
    if not isinstance(node, Node) or node.op != "call_method" or node.kwargs:
        return False
    return (node.target == "float" and len(node.args) == 1) or (
        node.target == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.dtype))


def _rotation_stack(split: Node) -> Optional[tuple[Node, Node, list[Node]]]:
    """``(cos, sin, nodes)`` of the stacked form of the rotation (adaptiveload's own Wan model,
    ``adaptiveload.models.rope.apply_rope``), the final node last::

        x1, x2 = split.to(compute).unflatten(-1, (-1, 2)).unbind(-1)    # the cast optional
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(dtype)

    (the last cast optional); None where the users of ``split`` are anything else."""
    src = _single_user(split, _cast) or split
    pair = _single_user(src, _is_pair_split)
    found = _halves(pair) if pair is not None else None
    if found is None:
        return None
    unbind, x1, x2 = found
    # the stack: behind a product of x1, behind the difference or sum that product feeds
    combo = _single_user(next(iter(x1.users)), lambda u: True) if x1.users else None
    stack = _single_user(combo, lambda u: u.op == "call_function" and u.target is torch.stack) if combo else None
    if stack is None or not isinstance(stack.args[0], (list, tuple)) or len(stack.args[0]) != 2:
        return None
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    if dim != -1 or set(stack.kwargs) - {"dim"}:
        return None
    rotated = _rotated(x1, x2, *stack.args[0])
    flat = _single_user(stack, lambda u: _method_or_function(u, "flatten", torch.flatten)
                        and tuple(u.args[1:]) in ((-2,), (-2, -1)) and not u.kwargs)
    if rotated is None or flat is None:
        return None
    cos, sin, math = rotated
    final = _single_user(flat, _cast) or flat
    nodes = [split, *([src] if src is not split else []), pair, unbind, x1, x2, *math, stack, flat]
    return cos, sin, nodes + ([final] if final is not flat else [])


def _rotation(split: Node) -> Optional[tuple[Node, Node, list[Node], str]]:
    """``(cos, sin, nodes, variant)`` of either written form of the rotation on ``split``, the nodes
    in graph order with the final one last; None for anything else, and where the final node (each
    form's last) is not last in graph order (a setitem after the read of the rotated tensor)."""
    for variant, find in ((VARIANT, _rotation_setitem), (VARIANT_STACK, _rotation_stack)):
        found = find(split)
        if found is not None:
            cos, sin, nodes = found
            order = {n: i for i, n in enumerate(split.graph.nodes)}
            ordered = sorted(nodes, key=order.__getitem__)
            return (cos, sin, ordered, variant) if ordered[-1] is nodes[-1] else None
    return None


def match(gm: GraphModule, node: Node) -> Optional[Match]:
    """The site at ``node`` when it is an RMSNorm whose output is split into heads and rotated as the
    module doc shows; None otherwise (the node goes on to the other patterns)."""
    site = norm_site(gm, node)
    if site is None or site.family != "rms_norm" or site.rejection is not None:
        return None
    splits = [u for u in site.output.users if _heads_split(u) is not None]
    found = _rotation(splits[0]) if len(splits) == 1 else None
    if found is None:
        return None
    cos, sin, nodes, variant = found
    candidate = RopeSite(site, _heads_split(splits[0]), cos, sin, nodes, variant=variant)
    inside = set(nodes)
    for n in (site.output, *nodes[:-1]):
        outside = [u for u in n.users if u not in inside]
        if outside:
            candidate.reason = f"`{n.name}` is also read by `{outside[0].name}` outside the rotation"
            break
    return Match([candidate], candidate.reason)


def _operand_value(operand: Any) -> Any:
    if isinstance(operand, ParamRef):
        return operand.tensor
    return fake_value(operand) if isinstance(operand, Node) else operand


def check(candidate: RopeSite, cache: Optional[dict] = None) -> Verdict:
    """Whether the op may replace the site: fake values present, a device type of
    :data:`~adaptiveload.ops.rms_norm_rope.op.FUSED_DEVICES`, the norm over the last dim only, a number
    for eps, and the op's fake kernel accepting the inputs."""
    site = candidate.site
    verdict = Verdict(reason=candidate.reason, layout="rope")
    if verdict.reason is not None:
        return verdict
    x, final = fake_value(site.input), fake_value(candidate.final)
    cos, sin = fake_value(candidate.cos), fake_value(candidate.sin)
    weight = _operand_value(site.weight)
    if any(v is None for v in (x, final, cos, sin)) or (site.weight is not None and weight is None):
        verdict.reason = NO_METADATA
        return verdict
    device = device_of(x)
    if device.type not in FUSED_DEVICES:
        verdict.reason = f"rms_norm_rope does not fold {device.type.upper()} sites (not in FUSED_DEVICES)"
        return verdict
    shape = site.normalized_shape
    dims = static_dims(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
    if dims != static_dims(x.shape)[-1:]:
        verdict.reason = f"the RMSNorm normalises over {shape}, not the last dim of {describe_fake('x', x)}"
        return verdict
    if site.eps is not None and not isinstance(site.eps, (int, float)):
        verdict.reason = "eps is computed in the graph, not a number"
        return verdict
    verdict.eps = float(site.eps) if site.eps is not None else rms_norm_default_eps(x.dtype)
    try:
        verdict.fake_outputs = fake_outputs(rms_norm_rope.default, final.fake_mode, (x, weight, cos, sin),
                                            (candidate.heads, verdict.eps, final.dtype), (final,), cache)
    except (ValueError, RuntimeError) as err:
        verdict.reason = f"the fused op rejects the inputs: {err}"
        return verdict
    if tuple(verdict.fake_outputs[0].shape) != tuple(final.shape):
        verdict.reason = f"the op's output {list(verdict.fake_outputs[0].shape)} is not {describe_fake('the rotation', final)}"
    return verdict


def replace(gm: GraphModule, candidate: RopeSite, verdict: Verdict, replaced: dict[Node, Node]) -> Node:
    """Replace the final node by ``getitem(rms_norm_rope(...), 0)`` and erase what that orphaned."""
    graph, site, final = gm.graph, candidate.site, candidate.final

    def operand(value: Any) -> Any:
        if isinstance(value, ParamRef):
            node = graph.get_attr(value.qualname)
            node.meta["val"] = fake_value(final).fake_mode.from_tensor(value.tensor, static_shapes=True)
            return node
        return replaced.get(value, value) if isinstance(value, Node) else value

    with graph.inserting_before(final):
        args = (operand(site.input), operand(site.weight), operand(candidate.cos), operand(candidate.sin),
                candidate.heads, verdict.eps, fake_value(final).dtype)
        (out,) = call_fused(graph, rms_norm_rope.default, args, verdict.fake_outputs, (final,), replaced)
    erase_unused(graph, [*candidate.nodes, site.output, site.node, *site.internal])
    return out


register_pattern("rms_norm_rope", match, check, replace, falls_through=True)
