"""``adaptiveload build``: compile the CUDA kernels ahead of a run and print where they are cached.

For clusters: build once (per node image or shared cache folder) before launching many ranks, which
then only load the cached module instead of compiling at their first step.
"""
from __future__ import annotations

import argparse
import sys


def _build(args: argparse.Namespace) -> int:
    from adaptiveload.ops import extension

    try:
        path = extension.build(verbose=args.verbose)
    except RuntimeError as err:
        print(f"adaptiveload build: error: cannot build the CUDA kernels: {' '.join(str(err).split())[:2000]}",
              file=sys.stderr)
        return 1
    print(path)
    return 0


def add_commands(subparsers) -> None:
    """Add ``build`` to the ``adaptiveload`` command line."""
    parser = subparsers.add_parser(
        "build",
        help="compile the fused-op CUDA kernels now and print the cache folder",
        description="Compile csrc/ for the current GPU (or TORCH_CUDA_ARCH_LIST) into the cache folder "
        "($ADAPTIVELOAD_CACHE, default ~/.cache/adaptiveload) and print its path.",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    parser.set_defaults(func=_build)
