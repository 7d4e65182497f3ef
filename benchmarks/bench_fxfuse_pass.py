"""How long the fusion pass takes on the Dynamo graph of a 40-block DiT (target: < 50 ms).

Captures the graph Dynamo hands a backend for two 40-block models at tiny widths (the pass's cost
depends on the number of nodes, not on the widths): diffusers' ``DiTTransformer2DModel`` and the
project's Wan-style ``WanDiT`` (with and without activation checkpointing, whose blocks the pass
reaches inside higher-order-op subgraphs). Times, per model, over ``--repeats`` runs on fresh
copies of the graph:

* ``fuse_adaln``: the pass alone (match, check, rewrite, recompile) on a copy of the graph made
  as the backend makes it: a ``_LazyGraphModule``, like the graph Dynamo hands a backend, whose
  ``recompile()`` defers Python code generation to the first call (which the inner compiler's
  tracing pays with or without the pass);
* ``copy + fuse_adaln``: what the backend spends (it rewrites a copy, so that a failing pass can
  fall back to the untouched graph).

Prints a table and writes JSON (machine, torch version, date, the exact command) to
``benchmarks/results/fxfuse_pass.json`` (or ``--out``).

    python benchmarks/bench_fxfuse_pass.py [--repeats 20] [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from adaptiveload.fxfuse import fuse_adaln
from adaptiveload.fxfuse.backend import copy_graph_module
from results_file import run_context

NUM_LAYERS = 40
TARGET_MS = 50.0


def capture_graph(model: torch.nn.Module, *inputs) -> torch.fx.GraphModule:
    """The (single, fullgraph) Dynamo graph of ``model(*inputs)`` in training mode."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    return graphs[0]


def diffusers_dit():
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=NUM_LAYERS, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000,
    )
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([1, 2]))
    return model, inputs


def project_wan(checkpointing: bool):
    from adaptiveload.models import PRESETS, build_model, make_inputs

    config = dataclasses.replace(PRESETS["tiny"], num_layers=NUM_LAYERS)
    model = build_model(config, activation_checkpointing=checkpointing).train()
    return model, make_inputs(config, batch_size=2, latent_shape=(2, 8, 8))


def time_pass(gm: torch.fx.GraphModule, repeats: int) -> dict:
    fuse_ms, total_ms, fused = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        work = copy_graph_module(gm)
        copied = time.perf_counter()
        report = fuse_adaln(work)
        end = time.perf_counter()
        fuse_ms.append((end - copied) * 1e3)
        total_ms.append((end - start) * 1e3)
        fused = report.fused
    nodes = sum(len(sub.graph.nodes) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule))
    return {
        "graph_nodes": nodes,
        "chains_fused": fused,
        "fuse_adaln_ms_median": statistics.median(fuse_ms),
        "fuse_adaln_ms_min": min(fuse_ms),
        "copy_and_fuse_ms_median": statistics.median(total_ms),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fxfuse_pass.json"))
    args = parser.parse_args(argv)

    cases = {
        f"diffusers DiTTransformer2DModel ({NUM_LAYERS} blocks)": diffusers_dit,
        f"adaptiveload WanDiT ({NUM_LAYERS} blocks)": lambda: project_wan(False),
        f"adaptiveload WanDiT ({NUM_LAYERS} blocks, checkpointed)": lambda: project_wan(True),
    }
    results = {}
    for name, build in cases.items():
        model, inputs = build()
        results[name] = time_pass(capture_graph(model, *inputs), args.repeats)

    header = f"{'graph':<52} {'nodes':>6} {'fused':>6} {'pass ms (median)':>17} {'pass ms (min)':>14} {'copy+pass ms':>13}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<52} {r['graph_nodes']:>6} {r['chains_fused']:>6} {r['fuse_adaln_ms_median']:>17.1f} "
              f"{r['fuse_adaln_ms_min']:>14.1f} {r['copy_and_fuse_ms_median']:>13.1f}")
    print(f"target: fuse_adaln < {TARGET_MS:.0f} ms on a {NUM_LAYERS}-block DiT graph")

    record = {
        "benchmark": "fxfuse_pass",
        **run_context(__file__, argv),
        "repeats": args.repeats,
        "target_ms": TARGET_MS,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
