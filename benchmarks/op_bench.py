"""What the op benchmarks of the norm-site families share (``bench_rms_norm.py``,
``bench_residual.py``): their command line, the GPU set-up (kernels required, the copy bandwidth
that speed-of-light is measured against) and the results file."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench_adaln import copy_bandwidth
from results_file import run_context, write_json_and_markdown


def op_arguments(description: str, default_D: list[int], results_name: str) -> argparse.ArgumentParser:
    """The shared flags: --B, --N, --D (op timings), --acc-N, --acc-D, --no-accuracy (accuracy rows
    against float64, op and Inductor), --out, --tag (``<results_name>_<tag>.json`` / ``.md``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--B", type=int, nargs="+", default=[1])
    parser.add_argument("--N", type=int, default=65536)
    parser.add_argument("--D", type=int, nargs="+", default=default_D)
    parser.add_argument("--acc-N", type=int, default=4096, help="sequence length of the accuracy rows")
    parser.add_argument("--acc-D", type=int, nargs="+", default=[3072], help="widths of the accuracy rows")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy rows (Inductor compiles)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tag", default="h200", help=f"results file name: {results_name}_<tag>.json / .md")
    return parser


def start(script: str):
    """``(triton.testing, a seeded CUDA generator, the copy bandwidth in bytes/s)`` with the kernels
    required (``ADAPTIVELOAD_REQUIRE_KERNEL=1``: no silent reference fallback); None, after saying so
    on stderr, without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU", file=sys.stderr)
        return None
    os.environ["ADAPTIVELOAD_REQUIRE_KERNEL"] = "1"
    import triton.testing as tt

    import adaptiveload  # noqa: F401  (registers the ops)

    bw = copy_bandwidth(tt)
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    return tt, torch.Generator(device="cuda").manual_seed(0), bw


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def finish(script: str, argv, args, results_name: str, bw: float, rows: list, acc: list, markdown) -> None:
    """Write ``<args.out>/<results_name>_<args.tag>.json`` and ``.md`` (the run's context, the GPU,
    the copy bandwidth, the timing rows and the accuracy rows; ``markdown(doc)`` the table) and print
    the table."""
    doc = {**run_context(script, argv), "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
           "copy_tb_s": bw / 1e12, "acc_N": args.acc_N, "rows": rows, "accuracy": acc}
    text = markdown(doc)
    write_json_and_markdown(str(args.out), f"{results_name}_{args.tag}", doc, text)
    print(text)
