"""The train job's printed report (runs side by side) and its PNG plot."""
from __future__ import annotations

import logging
import math
from typing import Optional

logger = logging.getLogger("adaptiveload.train")


def _fmt(value, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "ms":
        return f"{value * 1e3:,.1f}"
    if kind == "gib":
        return f"{value / 2**30:,.2f}"
    if kind == "ratio":
        return f"{value:.3f}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _rows(run: dict) -> list[tuple[str, str]]:
    peaks = run.get("peak_memory_bytes_per_rank")
    busy = run.get("busy_time_s_per_rank") or []
    predicted = (run.get("plan") or {}).get("predicted") or {}
    model = run.get("model") or {}
    return [
        ("backend", run["backend"]),
        ("policy", run["policy"]),
        ("status", run["status"]),
        ("steps", _fmt(run.get("steps"), "int")),
        ("samples", _fmt(run.get("samples"), "int")),
        ("tokens", _fmt(run.get("tokens"), "int")),
        ("wall time s (training)", _fmt(run.get("wall_time_s"), "")),
        ("tokens/s", _fmt(run.get("tokens_per_s"), "rate")),
        ("tokens/s (unprofiled steps)", _fmt(run.get("tokens_per_s_unprofiled"), "rate")),
        ("step time ms median", _fmt((run.get("step_time_s") or {}).get("median"), "ms")),
        ("step time ms p10 / p90", f"{_fmt((run.get('step_time_s') or {}).get('p10'), 'ms')} / "
                                   f"{_fmt((run.get('step_time_s') or {}).get('p90'), 'ms')}"),
        ("busy ms per rank (profiled)", " ".join(_fmt(b, "ms") for b in busy) or "-"),
        ("compute-load CV", _fmt(run.get("compute_load_cv"), "ratio")),
        ("idle fraction", _fmt(run.get("idle_fraction"), "ratio")),
        ("step composition KS / lag-1 corr", f"{_fmt(run.get('composition_ks'), 'ratio')} / "
                                            f"{_fmt(run.get('composition_lag1_corr'), 'ratio')}"),
        ("step time |predicted - measured| / measured, median", _fmt(run.get("step_time_rel_err_median"), "ratio")),
        ("peak memory GiB (max rank)", _fmt(max(peaks) if peaks else None, "gib")),
        ("fused chains / seen in compiled code / model norm sites (modulated)",
         f"{run.get('fused_chains', 0)} / {run.get('seen_chains', 0)} / {model.get('norm_sites') or '-'} "
         f"({model.get('modulate_sites') or '-'})"),
        ("compiled graphs (in timed steps)",
         f"{_fmt(run.get('compiled_graphs'), 'int')} ({_fmt(run.get('compiled_graphs_in_training'), 'int')}"
         + (f"; steps {', '.join(map(str, run['compile_steps']))})" if run.get("compile_steps") else ")")),
        ("eval loss first -> last", f"{_fmt(run['eval_loss'][0][1], '')} -> {_fmt(run.get('final_eval_loss'), '')}"
         if run.get("eval_loss") else "-"),
        ("plan M_mem tokens", _fmt((run.get("plan") or {}).get("m_mem"), "int")),
        ("predicted tokens/s", _fmt(predicted.get("equal_token_tokens_per_s") if run["policy"] == "equal_token"
                                    else predicted.get("tokens_per_s"), "rate")),
        ("warm-up / compile s", _fmt(run.get("warmup_s"), "")),
    ]


def format_report(results: dict) -> str:
    """The runs of a results dict side by side, one metric per line (a failed run's column too),
    then the speedup when both runs finished, and each failed run's error and hint."""
    runs = results["runs"]
    corpus = results["corpus"]
    data = {"synthetic": "synthetic latents and text", "files": "latents and text from the manifest's files"}
    lines = [
        f"adaptiveload train: {results['device']} x {results['world_size']}, torch {results['torch_version']}",
        f"corpus: {corpus['source']} - {corpus['samples']:,} samples, {corpus['buckets']} buckets, "
        f"S {corpus['seq_len_min']:,}..{corpus['seq_len_max']:,} (downscale {results['downscale']}"
        # the stride asked for (the corpus's own has the downscale folded into H and W)
        + (f", VAE stride {','.join(map(str, results['config'].get('vae_stride') or corpus['vae_stride']))}, "
           f"patch {','.join(map(str, corpus['patch_size']))}" if "patch_size" in corpus else "") + ")"
        + (f"; {data[corpus['data']]}" if "data" in corpus else ""),
    ]
    if runs:
        model = runs[0]["model"]
        lines.append(f"model: {model['name']}, {model['num_layers']} layers, {model['parameters']:,} parameters, "
                     f"activation checkpointing {'on' if model['activation_checkpointing'] else 'off'}")
    table = [_rows(r) for r in runs]
    width = max(len(name) for name, _ in table[0]) if table else 0
    col = [max(len(r["name"]), *(len(v) for _, v in rows)) for r, rows in zip(runs, table)]
    lines.append(f"{'':<{width}}  " + "  ".join(f"{r['name']:>{c}}" for r, c in zip(runs, col)))
    for i, (name, _) in enumerate(table[0] if table else []):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{rows[i][1]:>{c}}" for rows, c in zip(table, col)))
    if len(runs) == 2:
        failed = [r["name"] for r in runs if r["status"] != "ok"]
        lines.append(f"speedup (tokens/s, {runs[0]['name']} / {runs[1]['name']}): "
                     + (f"- ({' and '.join(failed)} failed)" if failed else
                        f"{runs[0]['tokens_per_s'] / runs[1]['tokens_per_s']:.3f}x"))
    for r in runs:
        if r.get("error"):
            lines.append(f"{r['name']}: {r['error']}")
        if r.get("hint"):
            lines.append(r["hint"])
    return "\n".join(lines)


def plot_results(results: dict, path: str) -> Optional[str]:
    """PNG with per-rank busy time, step time across steps and eval loss of every run.

    Returns:
        ``path`` when written, ``None`` without matplotlib.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("matplotlib is not installed: no results plot (pip install adaptiveload[plot])")
        return None
    fig = Figure(figsize=(14, 4.2))
    ax_busy, ax_step, ax_eval = fig.subplots(1, 3)
    runs = results["runs"]
    width = 0.8 / max(1, len(runs))
    for k, run in enumerate(runs):
        busy = run.get("busy_time_s_per_rank") or []
        ax_busy.bar([r + k * width for r in range(len(busy))], [b * 1e3 for b in busy], width=width, label=run["name"])
        history = run.get("history") or []
        ax_step.plot([h["step"] for h in history], [h["step_time_s"] * 1e3 for h in history], lw=1, label=run["name"])
        evals = run.get("eval_loss") or []
        ax_eval.plot([e[0] for e in evals], [e[1] for e in evals], "o-", ms=3, label=run["name"])
    ax_busy.set(xlabel="rank", ylabel="mean busy time per profiled step (ms)", title="per-rank compute")
    ax_step.set(xlabel="step", ylabel="step time (ms)", title="step time")
    ax_eval.set(xlabel="step", ylabel="flow-matching loss", title="fixed evaluation batch")
    for ax in (ax_busy, ax_step, ax_eval):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
