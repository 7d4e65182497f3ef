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
from dataclasses import dataclass
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
    """``(a, b)`` when ``node`` computes ``a * b`` (kind "mul") or ``a + b`` (kind "add", alpha 1),
    in operator, ``torch.*``, Tensor-method or aten form; None otherwise."""
    functions, method = (_MUL_FUNCTIONS, "mul") if kind == "mul" else (_ADD_FUNCTIONS, "add")
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
            "aten.native_layer_norm", or "RMSNorm" (any RMSNorm form; seen, never fused).
        node: the call itself.
        output: the node holding the normalised tensor (``node``, or its ``getitem(·, 0)``).
        input: the tensor normalised.
        normalized_shape: as written (a list of ints/SymInts/nodes).
        weight, bias: the affine parameters (a Node, a ParamRef, or None).
        eps: as written (a number, or a Node if computed).
    """

    kind: str
    node: Node
    output: Node
    input: Any
    normalized_shape: Any
    weight: Operand
    bias: Operand
    eps: Any

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


def _first_getitem(node: Node, index: int) -> Optional[Node]:
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _rms_norm_functions() -> set:
    functions = {getattr(torch, "rms_norm", None), getattr(F, "rms_norm", None)}
    for name in ("rms_norm", "_fused_rms_norm"):
        packet = getattr(aten, name, None)
        if packet is not None:
            functions.add(packet.default)
    functions.discard(None)
    return functions


_RMS_NORM_FUNCTIONS = _rms_norm_functions()
_FUSED_RMS_NORM = getattr(getattr(aten, "_fused_rms_norm", None), "default", None)  # returns a tuple
_LAYER_NORM_FUNCTIONS = {
    F.layer_norm: "F.layer_norm",
    torch.layer_norm: "F.layer_norm",
    aten.layer_norm.default: "aten.layer_norm",
}
_NORM_FUNCTIONS = {*_LAYER_NORM_FUNCTIONS, aten.native_layer_norm.default, *_RMS_NORM_FUNCTIONS}


def _module_param(node: Node, module: torch.nn.Module, name: str) -> Optional[ParamRef]:
    tensor = getattr(module, name)
    return None if tensor is None else ParamRef(f"{node.target}.{name}", tensor)


def norm_site(gm: GraphModule, node: Node) -> Optional[NormSite]:
    """The :class:`NormSite` of ``node`` if it is a LayerNorm or RMSNorm call, else None."""
    if node.op == "call_function":
        if node.target not in _NORM_FUNCTIONS:
            return None
        kind = _LAYER_NORM_FUNCTIONS.get(node.target)
        if kind is not None:
            return _layer_norm_site(kind, node, node)
        if node.target is aten.native_layer_norm.default:
            out = _first_getitem(node, 0)
            return None if out is None else _layer_norm_site("aten.native_layer_norm", node, out)
        if node.target in _RMS_NORM_FUNCTIONS:
            out = _first_getitem(node, 0) if node.target is _FUSED_RMS_NORM else node
            if out is None:
                return None
            return NormSite("RMSNorm", node, out, _arg(node, 0, "input"), _arg(node, 1, "normalized_shape"),
                            _arg(node, 2, "weight"), None, _arg(node, 3, "eps"))
        return None
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    if type(module) is torch.nn.LayerNorm:
        return NormSite("nn.LayerNorm", node, node, _arg(node, 0, "input"), list(module.normalized_shape),
                        _module_param(node, module, "weight"), _module_param(node, module, "bias"), module.eps)
    rms_norm_cls = getattr(torch.nn, "RMSNorm", None)
    if rms_norm_cls is not None and type(module) is rms_norm_cls:
        return NormSite("RMSNorm", node, node, _arg(node, 0, "input"), list(module.normalized_shape),
                        None, None, module.eps)
    return None
