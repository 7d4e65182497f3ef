"""Recognising single FX nodes across the three graph dialects the pass sees.

* Dynamo graphs (what a ``torch.compile`` backend receives): torch-level calls
  (``torch.nn.functional.layer_norm``, ``operator.mul``, ``call_method`` nodes such as ``.float()``),
  parameters as placeholders, fake values in ``node.meta["example_value"]``.
* ``torch.fx.symbolic_trace`` graphs: the same torch-level calls, ``nn.LayerNorm`` as
  ``call_module``, no metadata unless fake values were propagated (``node.meta["val"]``).
* ``torch.export`` graphs: aten overloads (``aten.layer_norm``, ``aten.native_layer_norm`` + getitem,
  ``aten.mul.Tensor``, ``aten._to_copy``, ...), fake values in ``node.meta["val"]``.

Everything here looks at one node (and its fake value) and answers one question; the chain
patterns built from these answers live in ``patterns.py``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

aten = torch.ops.aten

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# --- fake values ------------------------------------------------------------------------------


def fake_value(node: Any) -> Optional[torch.Tensor]:
    """The recorded fake tensor of ``node`` (``meta["val"]`` or Dynamo's ``meta["example_value"]``),
    or None when the node is not a Node or carries no tensor metadata."""
    if not isinstance(node, Node):
        return None
    for key in ("val", "example_value"):
        v = node.meta.get(key)
        if isinstance(v, torch.Tensor):
            return v
    return None


def static_dims(shape) -> list:
    """``shape`` with each symbolic size replaced by its sympy expression (plain ints stay ints).

    Comparing these compares sizes structurally: two sizes are equal only if their expressions are
    identical, and comparing never installs a guard on the ShapeEnv (a ``SymInt == SymInt`` would).
    """
    dims = []
    for d in shape:
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            d = int(expr) if expr.is_number else expr
        dims.append(d)
    return dims


def device_of(t: torch.Tensor) -> torch.device:
    """``t.device``, read without FakeTensor's slow ``device`` property when possible."""
    return getattr(t, "fake_device", None) or t.device


def is_floating(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.dtype in _FLOATING


# --- arithmetic ---------------------------------------------------------------------------------

_MUL_FUNCTIONS = {operator.mul, torch.mul, aten.mul.Tensor}
_ADD_FUNCTIONS = {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar}
_SUB_FUNCTIONS = {operator.sub, torch.sub, aten.sub.Tensor, aten.sub.Scalar}
_BINARY = {"mul": (_MUL_FUNCTIONS, "mul"), "add": (_ADD_FUNCTIONS, "add"), "sub": (_SUB_FUNCTIONS, "sub")}
_ADDCMUL_FUNCTIONS = {torch.addcmul, aten.addcmul.default}


def _is_call(node: Any, functions: set, method: str) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target == method


def _is_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def binary_operands(node: Any, kind: str) -> Optional[tuple[Any, Any]]:
    """``(a, b)`` when ``node`` computes ``a * b`` (kind "mul"), ``a + b`` ("add") or ``a - b``
    ("sub"; alpha 1), in operator, ``torch.*``, Tensor-method or aten form; None otherwise."""
    functions, method = _BINARY[kind]
    if not _is_call(node, functions, method) or len(node.args) != 2:
        return None
    if set(node.kwargs) - {"alpha"} or not _is_one(node.kwargs.get("alpha", 1)):
        return None
    return node.args[0], node.args[1]


def _operand_beside_one(node: Any, op: str) -> Optional[Node]:
    """``x`` when ``node`` is the binary ``op`` of ``x`` and the constant 1 (either order), else None."""
    ops = binary_operands(node, op)
    if ops is None:
        return None
    a, b = ops
    if _is_one(a) and isinstance(b, Node):
        return b
    if _is_one(b) and isinstance(a, Node):
        return a
    return None


def one_plus_operand(node: Any) -> Optional[Node]:
    """``scale`` when ``node`` computes ``1 + scale`` or ``scale + 1`` (any add form), else None."""
    return _operand_beside_one(node, "add")


_VIEW_METHODS = {"unsqueeze", "view", "reshape"}
_VIEW_FUNCTIONS = {
    operator.getitem,
    torch.unsqueeze,
    torch.reshape,
    aten.unsqueeze.default,
    aten.view.default,
    aten.reshape.default,
}


def view_source(node: Any) -> Optional[Node]:
    """The tensor ``node`` is a view of, when ``node`` only reshapes one tensor (``unsqueeze``,
    ``view``, ``reshape``, basic indexing such as ``[:, None]``); None otherwise."""
    if not isinstance(node, Node) or not node.args or fake_value(node.args[0]) is None:
        return None
    if not (
        (node.op == "call_method" and node.target in _VIEW_METHODS)
        or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
    ):
        return None
    others: list[Node] = []
    torch.fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    if any(fake_value(n) is not None for n in others):  # a tensor index: not a plain view
        return None
    return node.args[0]


_INDEX_SELECT = {torch.index_select, aten.index_select.default}
_INTEGER_INDEX = (torch.int32, torch.int64)


def row_gather(node: Any) -> Optional[tuple[Node, Node]]:
    """``(src, ids)`` when ``node`` gathers rows of a 2-D tensor by a 1-D integer tensor of row
    indices: ``src[ids]``, ``src.index_select(0, ids)``, ``torch.index_select(src, 0, ids)``,
    ``aten.index.Tensor(src, [ids])`` (fake values show src [n, D] and ids int32/int64 [T]); None
    otherwise (a boolean mask, a gather along another dim, more than one index)."""
    if not isinstance(node, Node) or len(node.args) < 2 or node.kwargs:
        return None
    src, index = node.args[0], None
    if node.op == "call_function" and node.target in (operator.getitem, aten.index.Tensor) and len(node.args) == 2:
        index = node.args[1]
        if node.target is aten.index.Tensor:
            index = index[0] if isinstance(index, (list, tuple)) and len(index) == 1 else None
    elif ((node.op == "call_function" and node.target in _INDEX_SELECT)
          or (node.op == "call_method" and node.target == "index_select")) and len(node.args) == 3:
        index = node.args[2] if node.args[1] in (0, -2) else None
    return (src, index) if _rows_by(src, index) else None


def _rows_by(src: Any, index: Any) -> bool:
    """Whether the fake values show ``src`` a 2-D floating tensor and ``index`` a 1-D int32/int64 one
    (row indices or row counts of it)."""
    src_val, index_val = fake_value(src), fake_value(index)
    return (src_val is not None and index_val is not None and src_val.dim() == 2 and is_floating(src_val)
            and index_val.dim() == 1 and index_val.dtype in _INTEGER_INDEX)


_REPEAT_INTERLEAVE = {torch.repeat_interleave, aten.repeat_interleave.self_Tensor}


def row_repeat(node: Any) -> Optional[tuple[Node, Node, Any]]:
    """``(src, repeats, output_size)`` when ``node`` repeats each row of a 2-D tensor by a 1-D
    integer tensor of counts with the output size given: ``src.repeat_interleave(repeats, dim=0,
    output_size=T)``, ``torch.repeat_interleave(src, repeats, dim=0, output_size=T)`` (the gather
    ``src[torch.repeat_interleave(repeats, output_size=T)]``); None otherwise (no output_size, whose
    size Dynamo cannot know, another dim, scalar repeats)."""
    if not isinstance(node, Node) or not (
            (node.op == "call_function" and node.target in _REPEAT_INTERLEAVE)
            or (node.op == "call_method" and node.target == "repeat_interleave")):
        return None
    names = ("input", "repeats", "dim", "output_size")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    if set(bound) - set(names) or bound.get("dim") not in (0, -2) or bound.get("output_size") is None:
        return None
    src, repeats = bound.get("input"), bound.get("repeats")
    return (src, repeats, bound["output_size"]) if _rows_by(src, repeats) else None


def last_dim_piece(node: Any) -> Optional[tuple[Node, int, int]]:
    """``(t, chunks, index)`` when ``node`` is piece ``index`` of ``t.chunk(chunks, dim=-1)`` (method,
    ``torch.chunk`` or ``aten.chunk``; the dim may be written as t's last index), t's last dim a
    multiple of ``chunks``; None otherwise."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[1], int)):
        return None
    split = node.args[0]
    if not isinstance(split, Node) or not (
            (split.op == "call_method" and split.target == "chunk")
            or (split.op == "call_function" and split.target in (torch.chunk, aten.chunk.default))):
        return None
    bound = {**dict(zip(("input", "chunks", "dim"), split.args)), **split.kwargs}
    t, chunks = bound.get("input"), bound.get("chunks")
    t_val = fake_value(t)
    if t_val is None or not isinstance(chunks, int) or chunks < 1 or set(bound) - {"input", "chunks", "dim"}:
        return None
    last = t_val.dim() - 1
    if bound.get("dim", 0) not in (-1, last) or not isinstance(t_val.shape[-1], int) or t_val.shape[-1] % chunks:
        return None
    return t, chunks, node.args[1]


def times_one_operand(node: Any) -> Optional[Node]:
    """``x`` when ``node`` computes ``x * 1`` (what decomposing ``addcmul``'s ``value=1`` leaves)."""
    return _operand_beside_one(node, "mul")


def addcmul_operands(node: Any) -> Optional[tuple[Any, Any, Any]]:
    """``(input, tensor1, tensor2)`` when ``node`` computes ``input + tensor1 * tensor2`` (value 1)."""
    if not _is_call(node, _ADDCMUL_FUNCTIONS, "addcmul") or len(node.args) != 3:
        return None
    if set(node.kwargs) - {"value"} or not _is_one(node.kwargs.get("value", 1)):
        return None
    return tuple(node.args)


# --- data flow ----------------------------------------------------------------------------------


def computed_from(value: Any, source: Node) -> bool:
    """True when ``value`` is ``source`` or is computed from it (``source`` is, transitively, one
    of its inputs); False for a constant. Both in one graph. Only nodes after ``source`` in graph
    order can read it, so the walk back from ``value`` stops at earlier ones."""
    if not isinstance(value, Node):
        return False
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if node is source:
            return True
        if node in seen or node < source:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


# --- dtype casts --------------------------------------------------------------------------------

_CAST_METHODS = {"float", "half", "bfloat16", "double", "to", "type_as", "type"}
_CAST_FUNCTIONS = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
    torch.ops.prims.convert_element_type.default,
}


def cast_source(node: Any) -> Optional[Node]:
    """The input of ``node`` when ``node`` only changes the floating dtype of a tensor (``.float()``,
    ``.to(dtype)``, ``.type_as(x)``, ``aten._to_copy``, ...): same shape and device, floating in and
    out, as the fake values show. None otherwise, and None without fake values."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    if not (
        (node.op == "call_method" and node.target in _CAST_METHODS)
        or (node.op == "call_function" and node.target in _CAST_FUNCTIONS)
    ):
        return None
    src, out = fake_value(node.args[0]), fake_value(node)
    if not (is_floating(src) and is_floating(out)):
        return None
    if device_of(src) != device_of(out) or static_dims(src.shape) != static_dims(out.shape):
        return None
    return node.args[0]


def narrows(cast: Node) -> bool:
    """True when the cast ``cast`` (one :func:`cast_source` recognises) may round or overflow: its
    dtype does not hold every value of its input's (float32 to float16/bfloat16, bfloat16 to
    float16 and back, float64 to float32, ...). False for a widening or a cast to the same dtype."""
    src, out = fake_value(cast.args[0]).dtype, fake_value(cast).dtype
    return torch.promote_types(src, out) != out


def strip_exact_casts(node: Any) -> tuple[Any, list[Node]]:
    """Follow casts back from ``node`` while each one is exact for a float32 computation (float16,
    bfloat16 or float32 to float32, or a cast to the same dtype). Returns the earliest node and the
    casts passed, latest first."""
    passed = []
    while True:
        src = cast_source(node)
        if src is None:
            return node, passed
        if narrows(node) or fake_value(node).dtype not in (fake_value(src).dtype, torch.float32):
            return node, passed
        passed.append(node)
        node = src


# --- norms --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamRef:
    """A LayerNorm parameter held by a ``call_module`` LayerNorm (symbolic_trace graphs): the rewrite
    reads it with a new ``get_attr`` node."""

    qualname: str
    tensor: torch.Tensor


Operand = Union[Node, ParamRef, None]


@dataclass
class NormSite:
    """One normalisation call in a graph.

    Attributes:
        kind: how it was written: "F.layer_norm", "nn.LayerNorm", "aten.layer_norm",
            "aten.native_layer_norm"; "F.rms_norm", "nn.RMSNorm", "aten.rms_norm",
            "aten._fused_rms_norm", or :data:`HAND_WRITTEN_RMS_NORM` (diffusers' ``RMSNorm`` and
            model code: ``x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)``, optionally
            times a weight).
        family: "layer_norm" or "rms_norm".
        node: the call itself (for the hand-written RMSNorm: the ``x * rsqrt(...)`` node).
        output: the node holding the normalised tensor (``node``, its ``getitem(·, 0)``, or the
            hand-written RMSNorm's weight product).
        input: the tensor normalised.
        normalized_shape: as written (a list of ints/SymInts/nodes).
        weight, bias: the affine parameters (a Node, a ParamRef, or None).
        eps: as written (a number, None for the op's default, or a Node if computed).
        internal: the norm's other nodes (the hand-written RMSNorm's square, mean, rsqrt, casts),
            which die with it when unused.
        rejection: why a norm that looks like one may not be fused (a hand-written RMSNorm that
            reduces over other dims, squares another tensor, ...); None when it may.
    """

    kind: str
    node: Node
    output: Node
    input: Any
    normalized_shape: Any
    weight: Operand
    bias: Operand
    eps: Any
    family: str = "layer_norm"
    internal: list = field(default_factory=list)
    rejection: Optional[str] = None

    @property
    def affine(self) -> bool:
        return self.weight is not None or self.bias is not None


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _layer_norm_site(kind: str, node: Node, output: Node) -> NormSite:
    return NormSite(
        kind=kind,
        node=node,
        output=output,
        input=_arg(node, 0, "input"),
        normalized_shape=_arg(node, 1, "normalized_shape"),
        weight=_arg(node, 2, "weight"),
        bias=_arg(node, 3, "bias"),
        eps=_arg(node, 4, "eps", 1e-5),
    )


def _rms_norm_site(kind: str, node: Node, output: Node) -> NormSite:
    return NormSite(kind, node, output, _arg(node, 0, "input"), _arg(node, 1, "normalized_shape"),
                    _arg(node, 2, "weight"), None, _arg(node, 3, "eps"), family="rms_norm")


def _first_getitem(node: Node, index: int) -> Optional[Node]:
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _rms_norm_functions() -> dict:
    functions = {getattr(torch, "rms_norm", None): "F.rms_norm", getattr(F, "rms_norm", None): "F.rms_norm"}
    for name in ("rms_norm", "_fused_rms_norm"):
        packet = getattr(aten, name, None)
        if packet is not None:
            functions[packet.default] = f"aten.{name}"
    functions.pop(None, None)
    return functions


_RMS_NORM_FUNCTIONS = _rms_norm_functions()
_FUSED_RMS_NORM = getattr(getattr(aten, "_fused_rms_norm", None), "default", None)  # returns a tuple
_LAYER_NORM_FUNCTIONS = {
    F.layer_norm: "F.layer_norm",
    torch.layer_norm: "F.layer_norm",
    aten.layer_norm.default: "aten.layer_norm",
}
_NORM_FUNCTIONS = {*_LAYER_NORM_FUNCTIONS, aten.native_layer_norm.default, *_RMS_NORM_FUNCTIONS}


def rms_norm_default_eps(dtype: torch.dtype) -> float:
    """The eps ``F.rms_norm`` uses when given None: float32's machine epsilon, float64's for float64
    input (``torch/_decomp/decompositions.py``: ``_fused_rms_norm``)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _module_param(node: Node, module: torch.nn.Module, name: str) -> Optional[ParamRef]:
    tensor = getattr(module, name)
    return None if tensor is None else ParamRef(f"{node.target}.{name}", tensor)


def norm_site(gm: GraphModule, node: Node) -> Optional[NormSite]:
    """The :class:`NormSite` of ``node`` if it is a LayerNorm or RMSNorm call (an RMSNorm written
    out by hand included, see :func:`hand_written_rms_norm`), else None."""
    if node.op == "call_function":
        if node.target not in _NORM_FUNCTIONS:
            return hand_written_rms_norm(node)
        kind = _LAYER_NORM_FUNCTIONS.get(node.target)
        if kind is not None:
            return _layer_norm_site(kind, node, node)
        if node.target is aten.native_layer_norm.default:
            out = _first_getitem(node, 0)
            return None if out is None else _layer_norm_site("aten.native_layer_norm", node, out)
        out = _first_getitem(node, 0) if node.target is _FUSED_RMS_NORM else node
        return None if out is None else _rms_norm_site(_RMS_NORM_FUNCTIONS[node.target], node, out)
    if node.op != "call_module":
        return hand_written_rms_norm(node)
    module = gm.get_submodule(node.target)
    if type(module) is torch.nn.LayerNorm:
        return NormSite("nn.LayerNorm", node, node, _arg(node, 0, "input"), list(module.normalized_shape),
                        _module_param(node, module, "weight"), _module_param(node, module, "bias"), module.eps)
    rms_norm_cls = getattr(torch.nn, "RMSNorm", None)
    if rms_norm_cls is not None and type(module) is rms_norm_cls:
        return NormSite("nn.RMSNorm", node, node, _arg(node, 0, "input"), list(module.normalized_shape),
                        _module_param(node, module, "weight"), None, module.eps, family="rms_norm")
    return None


# --- the hand-written RMSNorm -------------------------------------------------------------------

HAND_WRITTEN_RMS_NORM = "x*rsqrt(mean(x²)+eps)"

_RSQRT_FUNCTIONS = {torch.rsqrt, aten.rsqrt.default}
_MEAN_FUNCTIONS = {torch.mean, aten.mean.dim}
_POW_FUNCTIONS = {torch.pow, operator.pow, aten.pow.Tensor_Scalar}
_SQUARE_FUNCTIONS = {torch.square, getattr(aten, "square", aten.pow).default}


def _unary_source(node: Any, functions: set, method: str) -> Optional[Node]:
    if _is_call(node, functions, method) and node.args and isinstance(node.args[0], Node):
        return node.args[0]
    return None


def _squared(node: Any) -> tuple[Optional[Node], Optional[str]]:
    """``(t, None)`` when ``node`` computes ``t ** 2`` (pow, square, ``t * t``); ``(t, reason)`` for
    another power of one tensor; ``(None, None)`` otherwise."""
    src = _unary_source(node, _POW_FUNCTIONS, "pow")
    if src is not None:
        exponent = _arg(node, 1, "exponent")
        return src, None if exponent == 2 else f"raises to the power {exponent!r}, not 2"
    src = _unary_source(node, _SQUARE_FUNCTIONS, "square")
    if src is not None:
        return src, None
    ops = binary_operands(node, "mul")
    if ops is not None and ops[0] is ops[1] and isinstance(ops[0], Node):
        return ops[0], None
    return None, None


def _is_parameter(node: Any) -> bool:
    """A graph input or attribute (a parameter), possibly through dtype casts."""
    node, _ = strip_casts(node)
    return isinstance(node, Node) and node.op in ("placeholder", "get_attr")


def strip_casts(node: Any) -> tuple[Any, list[Node]]:
    """Follow every dtype cast back from ``node``; the earliest node and the casts passed."""
    passed = []
    while (src := cast_source(node)) is not None:
        passed.append(node)
        node = src
    return node, passed


def hand_written_rms_norm(node: Node) -> Optional[NormSite]:
    """The :class:`NormSite` of an RMSNorm written out, anchored at ``node`` = ``x * rsqrt(r)``:

        r = mean(square(x'), dim=-1, keepdim=True) + eps      (x' = x or a dtype cast of it)
        output = node, or node [.to(w.dtype)] * w              (w a parameter of shape [D])

    as diffusers' ``RMSNorm`` and model code write it (``.pow(2)``, ``torch.square``, ``x * x``;
    ``torch.rsqrt`` or ``.rsqrt()``; operator, ``torch.*``, method or aten forms). A norm of this
    shape that is not an RMSNorm over the last dim (another dim, ``keepdim=False``, another power,
    a computed eps, or ``x'`` not an exact cast of ``x``) is a site with a ``rejection``. None when
    ``node`` is not ``x * rsqrt(mean(...) + number or node)``.
    """
    ops = binary_operands(node, "mul")
    if ops is None:
        return None
    for x, r in (ops, ops[::-1]):
        added = _unary_source(r, _RSQRT_FUNCTIONS, "rsqrt")
        add_ops = binary_operands(added, "add")
        if add_ops is None or not isinstance(x, Node):
            continue
        for mean, eps in (add_ops, add_ops[::-1]):
            if _is_call(mean, _MEAN_FUNCTIONS, "mean") and not (isinstance(eps, Node) and eps is mean):
                return _hand_written_site(node, x, r, added, mean, eps)
    return None


def _hand_written_site(node: Node, x: Node, rsqrt: Node, added: Node, mean: Node, eps: Any) -> NormSite:
    square = mean.args[0]
    squared, rejection = _squared(square)
    internal = [rsqrt, added, mean]
    if squared is None:
        rejection = f"the mean is of `{getattr(square, 'name', square)}`, not of a square"
    else:
        internal += [square, *strip_casts(squared)[1]]
        dims, keepdim = _arg(mean, 1, "dim"), _arg(mean, 2, "keepdim", False)
        x_val = fake_value(x)
        ndim = None if x_val is None else x_val.dim()
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        if rejection is None and ndim is not None and [d % ndim if isinstance(d, int) else d for d in dims] != [ndim - 1]:
            rejection = f"the mean is over dims {dims}, not the last one"
        elif rejection is None and keepdim is not True:
            rejection = "the mean is not taken with keepdim=True"
        elif rejection is None and strip_exact_casts(squared)[0] is not strip_exact_casts(x)[0]:
            rejection = f"squares `{squared.name}`, not an exact cast of the normalised `{x.name}`"
    if isinstance(eps, Node) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        rejection = rejection or "eps is computed in the graph"
    x_val = fake_value(x)
    shape = None if x_val is None else [x_val.shape[-1]]
    output, weight = node, None
    user = next(iter(node.users)) if len(node.users) == 1 else None
    cast = user if user is not None and cast_source(user) is node and len(user.users) == 1 else None
    product = next(iter(cast.users)) if cast is not None else user
    w = _weight_operand(product, cast or node, shape)
    if w is not None:
        output, weight = product, w
        internal = ([cast] if cast is not None else []) + internal
    return NormSite(HAND_WRITTEN_RMS_NORM, node, output, x, shape, weight, None, eps, family="rms_norm",
                    internal=internal, rejection=rejection)


def _weight_operand(product: Any, value: Node, shape: Optional[list]) -> Optional[Node]:
    """``w`` when ``product`` is ``value * w`` with ``w`` a parameter of shape ``shape`` ([D])."""
    ops = binary_operands(product, "mul")
    if ops is None or shape is None:
        return None
    for a, w in (ops, ops[::-1]):
        if a is value and w is not value and _is_parameter(w):
            w_val = fake_value(w)
            if is_floating(w_val) and static_dims(w_val.shape) == static_dims(shape):
                return w
    return None
