"""``adaptiveload inspect``: list the norm→modulate chains of a user's model (and what any registered
pattern matches) before a long run.

    adaptiveload inspect mypkg.models:build_dit
    adaptiveload inspect path/to/model.py:build --input-shapes "2,256,64;2,64" --dtype bfloat16

``MODULE:FACTORY`` names a zero-argument callable, in an importable module (the current directory is
on the path) or in a ``.py`` file. It returns either

* an ``nn.Module`` -- then ``--input-shapes`` gives its positional inputs, random normal tensors, or
* ``(module, inputs)`` -- ``inputs`` a tuple/list of positional arguments or a dict of keyword
  arguments (``--input-shapes``, when given, replaces them).

The model runs once (with autograd enabled, in the mode the factory left it, so activation
checkpointing shows as it will in training) under ``torch.compile`` with a backend that captures
each Dynamo graph and runs :func:`adaptiveload.fxfuse.fuse_adaln` on a copy; nothing is compiled.
The command prints one table per graph with chains (the pattern that matched, location, source line,
norm, variant, modulation layout, fused or skipped and why) and, to stdout whatever the logging
setup, the total summary line "total: fused N chains (M seen, K skipped: reasons) [fused/seen:
<pattern> F/S, ...]".
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from adaptiveload.fxfuse.backend import copy_graph_module
from adaptiveload.fxfuse.report import FusionReport
from adaptiveload.fxfuse.rewrite import fuse_adaln

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="list the norm→modulate chains of a model, the pattern of each and whether the backend fuses it",
        description=__doc__.split("\n\n")[0],
        epilog="The factory returns an nn.Module, or (module, inputs) with inputs a tuple/list of positional "
        "arguments or a dict of keyword arguments.",
    )
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="zero-argument factory, e.g. mypkg.models:build or path/to/model.py:build")
    parser.add_argument("--input-shapes", metavar="SHAPES",
                        help='random normal positional inputs, one shape per tensor: "2,16,64;2,64"')
    parser.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="cast the model's parameters and the floating inputs to this dtype")
    parser.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    factory = load_factory(args.target)
    model, inputs = _call_factory(factory, args.target)
    if args.input_shapes is not None:
        inputs = tuple(torch.randn(shape) for shape in parse_shapes(args.input_shapes))
    if inputs is None:
        raise ValueError(f"{args.target} returned a module without inputs: give --input-shapes")
    if args.dtype is not None:
        dtype = _DTYPES[args.dtype]
        model = model.to(dtype)
        inputs = _map_tensors(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
    try:
        reports = trace_and_inspect(model, inputs)
    except Exception as err:  # the model does not run on these inputs: one line, not a Dynamo traceback
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{args.target} failed on inputs {_describe_inputs(inputs)}: "
                         f"{type(err).__name__}: {message}") from None
    total = FusionReport([c for r in reports for c in r.chains], [c for r in reports for c in r.deferred])
    print(f"Dynamo captured {len(reports)} graph(s) from {args.target}")
    for i, report in enumerate(reports):
        if report.seen or report.deferred:
            print(f"\ngraph {i}:")
            print(report.table())
    print(f"\ntotal: {total.summary()}")
    return 0


def _describe_inputs(inputs: Any) -> str:
    """Shapes of the inputs, e.g. ``(shape [2, 4], shape [2])`` or ``{x: shape [2, 4]}``."""
    def one(v):
        return f"shape {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
    if isinstance(inputs, dict):
        return "{" + ", ".join(f"{k}: {one(v)}" for k, v in inputs.items()) + "}"
    return "(" + ", ".join(one(v) for v in inputs) + ")"


def trace_and_inspect(model: torch.nn.Module, inputs: Any) -> list[FusionReport]:
    """Run ``model`` once under Dynamo and return the fusion report of each captured graph."""
    reports = []

    def capture(gm, example_inputs):
        reports.append(fuse_adaln(copy_graph_module(gm)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture, dynamic=False)
    if isinstance(inputs, dict):
        compiled(**inputs)
    else:
        compiled(*inputs)
    return reports


def load_factory(target: str) -> Callable:
    """The callable named by ``MODULE:FACTORY`` (a dotted module path or a ``.py`` file).

    Raises:
        ValueError: not of the form MODULE:FACTORY, a module that cannot be imported, a missing
            attribute, or an attribute that is not callable.
    """
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mypkg.models:build or model.py:build), got {target!r}")
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name))
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"cannot import module {module_name!r}: {err}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"{target} is a {type(factory).__name__}, not a callable factory")
    return factory


def _import_file(path: Path):
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"_adaptiveload_inspect_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call_factory(factory: Callable, target: str) -> tuple[torch.nn.Module, Any]:
    result = factory()
    if isinstance(result, torch.nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        if not isinstance(result[1], (tuple, list, dict)):
            raise ValueError(f"{target} returned inputs of type {type(result[1]).__name__}: expected a tuple/list "
                             f"of positional arguments or a dict of keyword arguments")
        return result
    raise ValueError(f"{target} returned {type(result).__name__}: expected an nn.Module or (module, inputs)")


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"2,16,64;2,64"`` -> ``[(2, 16, 64), (2, 64)]``.

    Raises:
        ValueError: an empty list, or a shape that is not comma-separated positive ints (the message
            names the tensor, counting from 1).
    """
    shapes = []
    for i, part in enumerate(text.split(";"), start=1):
        try:
            shape = tuple(int(d) for d in part.split(","))
        except ValueError:
            shape = ()
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"--input-shapes: tensor {i} {part.strip()!r} is not comma-separated positive ints "
                             f"(expected e.g. \"2,16,64;2,64\")")
        shapes.append(shape)
    return shapes


def _map_tensors(inputs: Any, fn: Callable) -> Any:
    if isinstance(inputs, dict):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return type(inputs)(fn(v) if isinstance(v, torch.Tensor) else v for v in inputs)
