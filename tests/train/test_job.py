"""The ``adaptiveload train`` job end to end: the CPU default run (short), two ranks under torchrun,
kill-and-resume, an out-of-memory bucket on one rank, and bad input."""
import json
import math

import numpy as np
import pytest
import torch


SHORT = ("--samples", "48", "--steps", "6", "--eval-every", "3", "--profile-every", "2", "--quiet")


def _results(out):
    return json.loads((out / "results.json").read_text())


def _check_run(run, world_size, steps):
    assert run["status"] == "ok" and run["error"] is None
    assert run["steps"] == steps == len(run["history"])
    assert run["world_size"] == world_size
    history = run["history"]
    assert [h["step"] for h in history] == list(range(steps))
    for h in history:  # every rank reported every step
        assert len(h["batch_sizes"]) == len(h["seq_lens"]) == len(h["indices"]) == world_size
        assert [len(i) for i in h["indices"]] == h["batch_sizes"]
        assert h["global_samples"] == sum(h["batch_sizes"])
        assert h["global_tokens"] == sum(b * s for b, s in zip(h["batch_sizes"], h["seq_lens"]))
        assert h["step_time_s"] > 0 and math.isfinite(h["loss"]) and h["loss"] > 0
    assert run["samples"] == sum(h["global_samples"] for h in history)
    assert run["tokens"] == sum(h["global_tokens"] for h in history)
    assert run["wall_time_s"] == pytest.approx(sum(h["step_time_s"] for h in history))
    assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_time_s"])
    assert run["step_time_s"]["min"] <= run["step_time_s"]["median"] <= run["step_time_s"]["max"]
    profiled = [h["busy_s"] for h in history if h["busy_s"] is not None]
    assert len(profiled) == run["profiled_steps"] == len(range(0, steps, 2))
    assert len(run["busy_time_s_per_rank"]) == world_size and all(b > 0 for b in run["busy_time_s_per_rank"])
    busy = np.array(profiled)
    cv = np.mean(busy.std(axis=1) / busy.mean(axis=1))
    idle = np.mean(1 - busy.mean(axis=1) / busy.max(axis=1))
    assert run["compute_load_cv"] == pytest.approx(cv) and run["idle_fraction"] == pytest.approx(idle)
    assert run["peak_memory_bytes_per_rank"] is None  # CPU
    expected_evals = sorted(set(range(0, steps + 1, 3)) | {steps})  # --eval-every 3, and at the end
    assert [e[0] for e in run["eval_loss"]] == expected_evals and all(e[1] > 0 for e in run["eval_loss"])
    assert run["final_eval_loss"] == run["eval_loss"][-1][1]
    assert run["plan"]["m_mem"] >= 1 and run["plan"]["predicted"]["tokens_per_s"] > 0
    assert run["model"]["name"] == "tiny" and run["model"]["parameters"] > 0 and run["model"]["modulate_sites"] == 5
    assert run["model"]["norm_sites"] == 7  # the tiny preset's 2 blocks: norm1-3 each, and the head
    assert run["warmup_s"] > 0 and run["compiled_graphs"] >= run["compiled_graphs_in_training"] >= 0
    assert run["tokens_per_s_unprofiled"] > 0
    assert all(isinstance(h["compiled"], bool) for h in history)
    assert run["compile_steps"] == [h["step"] for h in history if h["compiled"]]


@pytest.mark.slow
def test_default_cpu_run_end_to_end(tmp_path, run_cli):
    """The README's first command (shortened with --samples/--steps): every report field is filled."""
    out = tmp_path / "out"
    proc = run_cli("train", *SHORT, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out)
    assert results["device"] == "cpu" and results["world_size"] == 1 and results["downscale"] == 8
    assert results["corpus"]["samples"] == 48 and results["corpus"]["seq_len_max"] <= 1050
    (run,) = results["runs"]
    _check_run(run, world_size=1, steps=6)
    assert run["backend"] == "adaptiveload(eager)" and run["policy"] == "dual"
    # per forward, in each of the 2 compiled blocks: norm1 (adaln_modulate), norm2 and norm3 with the
    # residual in front of each (residual_adaln_modulate), and the self-attention's q and k RMSNorm ->
    # RoPE (rms_norm_rope); the head's chain runs in the eager root
    assert run["fused_chains"] == run["seen_chains"] == 2 * 5
    assert 1 <= run["compiled_graphs"] <= 2  # blocks: one graph per batch-size class (B = 1 or not), not per bucket
    assert run["compiled_graphs_in_training"] == 0 and run["compile_steps"] == []  # all compiled in warm-up
    assert run["compute_load_cv"] == 0 and run["idle_fraction"] == 0  # one rank
    assert (out / "calibration.json").is_file() and (out / "results.png").is_file()
    assert "profiler_start" not in proc.stderr  # --quiet silences Kineto's lines too
    for label in ("tokens/s", "compute-load CV", "idle fraction", "peak memory GiB", "fused chains / seen",
                  "eval loss first -> last", "step time ms median", "busy ms per rank"):
        assert label in proc.stdout
    assert "adaptiveload+dual" in proc.stdout and "results:" in proc.stdout


@pytest.mark.slow
def test_activation_checkpointing_run_fuses_inside_checkpointed_blocks(tmp_path, run_cli):
    """--activation-checkpointing on: the quick calibration compiles each graph inside a checkpointed
    block (its recomputation must match: every calibration point runs), every chain is still fused,
    and training finishes."""
    out = tmp_path / "out"
    proc = run_cli("train", *SHORT, "--activation-checkpointing", "on", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads((out / "calibration.json").read_text())["points"]
    assert points and [p["status"] for p in points] == ["ok"] * len(points), points
    (run,) = _results(out)["runs"]
    _check_run(run, world_size=1, steps=6)
    assert run["model"]["activation_checkpointing"] is True
    assert run["fused_chains"] == run["seen_chains"] == 2 * 5 and run["compiled_graphs_in_training"] == 0


@pytest.mark.slow
def test_two_ranks_with_activation_checkpointing_and_inductor(tmp_path, run_cli):
    """FSDP2 + activation checkpointing + Inductor, every batch kind compiled in warm-up. With the
    checkpoint taken around the block call, the recomputation re-entered the compiled forward with
    FSDP2's inputs no longer views, recompiled a different graph and failed with CheckpointError
    (seen on two H200s at the first B = 2 bucket); the step now checkpoints inside each block."""
    out = tmp_path / "out"
    args = ("--samples", "48", "--steps", "2", "--eval-every", "5", "--profile-every", "0", "--quiet")
    proc = run_cli("train", *args, "--backend", "inductor", "--activation-checkpointing", "on", "--out", out, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = _results(out)["runs"]
    assert run["status"] == "ok" and run["steps"] == 2 and run["model"]["activation_checkpointing"] is True
    assert run["compiled_graphs_in_training"] == 0


@pytest.mark.slow
def test_two_ranks_finish_together_with_complete_metrics(tmp_path, run_cli):
    out = tmp_path / "out"
    args = ("--samples", "48", "--eval-every", "3", "--profile-every", "2", "--quiet", "--backend", "eager")
    proc = run_cli("train", *args, "--baseline", "--out", out, nproc=2)  # one epoch each
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out)
    assert results["world_size"] == 2
    main, baseline = results["runs"]
    _check_run(main, world_size=2, steps=main["steps_per_epoch"])
    _check_run(baseline, world_size=2, steps=baseline["steps_per_epoch"])
    assert baseline["policy"] == "equal_token" and baseline["backend"] == "eager"
    assert main["eval_loss"][0] == baseline["eval_loss"][0]  # same initial weights, same evaluation batch
    for run in (main, baseline):  # one epoch covers every sample (a few whole batches repeat to fill W)
        seen = [i for h in run["history"] for rank in h["indices"] for i in rank]
        assert set(seen) == set(range(48))
    assert "speedup (tokens/s" in proc.stdout


@pytest.mark.slow
def test_kill_and_resume_continues_the_sample_stream_and_model_exactly(tmp_path, run_cli, checkpoint_weights):
    args = ("--samples", "40", "--backend", "eager", "--eval-every", "2", "--profile-every", "0",
            "--checkpoint-every", "1", "--quiet")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", *args, "--steps", "6", "--out", straight).returncode == 0
    first = run_cli("train", *args, "--steps", "4", "--out", resumed)  # the job stops after 4 steps
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train", *args, "--steps", "6", "--resume", "--out", resumed)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = _results(straight)["runs"][0], _results(resumed)["runs"][0]
    assert [h["indices"] for h in b["history"]] == [h["indices"] for h in a["history"]]
    assert [h["loss"] for h in b["history"]] == [h["loss"] for h in a["history"]]
    assert b["eval_loss"] == a["eval_loss"]
    wa, wb = checkpoint_weights(straight / "eager_dual"), checkpoint_weights(resumed / "eager_dual")
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.slow
def test_out_of_memory_in_a_bucket_names_it_and_keeps_results(tmp_path, run_cli):
    """Rank 1 runs out of memory on long videos: every rank stops, the message names the bucket and B."""
    out = tmp_path / "out"
    proc = run_cli("train", "--model", "faulty_model:oom_on_rank1_long_videos", "--backend", "eager",
                   "--calibration", "anchors-wan1.3b", "--m-mem", "2100", "--samples", "64", "--eval-every", "1",
                   "--profile-every", "0", "--dist-timeout", "10", "--quiet", "--out", out, nproc=2, timeout=200)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 1 ran out of memory on bucket latent" in proc.stdout
    assert "with B=" in proc.stdout and "recalibrate with a smaller memory budget" in proc.stdout
    (run,) = _results(out)["runs"]
    assert run["status"] == "failed" and "rank 1 ran out of memory" in run["error"]
    assert run["steps"] == len(run["history"])  # the steps before the failure are kept


@pytest.mark.slow
def test_non_finite_gradient_in_a_bucket_names_it_and_keeps_the_weights(tmp_path, run_cli):
    """A NaN gradient at one shape stops the run in warm-up (which covers the longest bucket) with the
    bucket, B and the parameter named; nothing is written into the weights."""
    out = tmp_path / "out"
    proc = run_cli("train", "--model", "faulty_model:nan_gradient_on_long_videos", "--backend", "eager",
                   "--calibration", "anchors-wan1.3b", "--m-mem", "2100", "--samples", "64",
                   "--profile-every", "0", "--quiet", "--out", out, timeout=200)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "warm-up step" in proc.stdout and "rank 0 got a non-finite loss or gradient on bucket latent" in proc.stdout
    assert "non-finite gradients in" in proc.stdout and "the optimizer step was skipped" in proc.stdout
    assert "the weights are unchanged" in proc.stdout
    (run,) = _results(out)["runs"]
    assert run["status"] == "failed" and "non-finite" in run["error"]


@pytest.mark.parametrize("args, message", [
    (("--preset", "wan9"), "unknown model preset 'wan9'"),
    (("--manifest", "MISSING.csv"), "MISSING.csv"),
    (("--policy", "cost_grouped", "--plan", "PLAN4"), "was planned for world size 4, but this job runs on 1"),
    (("--plan", "PLAN1"), "re-plan this corpus with `adaptiveload plan` (the job writes it as manifest.csv in "
                          "--out; --vae-stride 4,64,64 --patch-size 1,2,2) or omit --plan"),
])
def test_bad_input_gives_one_clear_line(tmp_path, run_cli, args, message):
    """Bad input stops the job before any step: a full-resolution plan (world size 1, as made for a
    GPU) does not fit the CPU job's downscaled corpus."""
    for name, world_size in (("PLAN4", 4), ("PLAN1", 1)):
        if name in args:
            from adaptiveload.sched.plan import make_plan
            from adaptiveload.sched.presets import load_calibration
            from adaptiveload.sched.manifest import reference_mix

            plan = make_plan(reference_mix(64, 0), load_calibration("anchors-wan1.3b"), world_size, m_mem=151200)
            plan.save(tmp_path / "plan.json")
            args = tuple(str(tmp_path / "plan.json") if a == name else a for a in args)
            args += ("--calibration", "anchors-wan1.3b")
    proc = run_cli("train", "--samples", "8", "--backend", "eager", "--quiet", "--out", tmp_path / "o", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_bad_manifest_row_is_named(tmp_path, run_cli):
    bad = tmp_path / "bad.csv"
    bad.write_text("num_frames,height,width\n81,480,832\n-3,480,832\n")
    proc = run_cli("train", "--manifest", bad, "--backend", "eager", "--quiet", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "bad.csv" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("given, policy", [("dual", "dual"), ("cost_grouped", "cost_grouped"),
                                           ("equal_token", "equal_token"), ("random", "dual"),
                                           ("equal-token", "equal_token"), ("cost-grouped", "cost_grouped")])
def test_job_config_takes_every_policy_spelling(given, policy):
    from adaptiveload.train.job import JobConfig, RunSpec, job_runs
    from adaptiveload.train.distributed import DistContext

    cfg = JobConfig(policy=given, baseline=True)
    assert cfg.policy == policy
    assert job_runs(cfg, DistContext()) == [RunSpec(f"adaptiveload+{policy}", "adaptiveload", "eager", policy),
                                            RunSpec("baseline:eager+equal_token", "eager", "eager", "equal_token")]
    with pytest.raises(ValueError, match="unknown policy 'fast'; choose one of equal_token, dual, cost_grouped"):
        JobConfig(policy="fast")


TINY_SHAPES = [(1, 4, 6), (3, 4, 6), (2, 6, 8)]  # S = 6, 18, 24 with the 1x2x2 patch


@pytest.mark.slow
def test_training_on_sample_files(tmp_path, run_cli, tiny_dataset):
    """The tiny model on its own latent and text files (safetensors and .pt, text shorter than
    text_len), read by DataLoader worker processes: every sample of the epoch is trained on."""
    manifest = tiny_dataset(tmp_path / "data", TINY_SHAPES, 12)
    out = tmp_path / "out"
    proc = run_cli("train", "--manifest", manifest, "--backend", "eager", "--eval-every", "2", "--quiet",
                   "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out)
    corpus = results["corpus"]
    assert corpus["data"] == "files" and corpus["samples"] == 12 and results["downscale"] == 1  # CPU: not downscaled
    assert (corpus["seq_len_min"], corpus["seq_len_max"]) == (6, 24)
    (run,) = results["runs"]
    assert run["status"] == "ok" and run["steps"] == run["steps_per_epoch"] and run["error"] is None
    seen = [i for h in run["history"] for rank in h["indices"] for i in rank]
    assert set(seen) == set(range(12))
    for h in run["history"]:  # each batch's S is its samples' shape's (rows cycle through TINY_SHAPES)
        (indices,), (seq_len,) = h["indices"], h["seq_lens"]
        assert {6: 0, 18: 1, 24: 2}[seq_len] == indices[0] % 3 and all(i % 3 == indices[0] % 3 for i in indices)
    assert all(math.isfinite(e[1]) and e[1] > 0 for e in run["eval_loss"])
    assert "latents and text from the manifest's files" in proc.stdout


@pytest.mark.slow
def test_an_unreadable_sample_file_stops_both_ranks_naming_row_and_path(tmp_path, run_cli, tiny_dataset):
    """A latent file that exists but cannot be read (missing files are refused before any step): the
    rank drawing it cannot load its batch; neither rank trains that step (no hang), the job exits 1
    naming the manifest row and path, and the steps before it stay in results.json."""
    from adaptiveload.sched.manifest import load_manifest
    from adaptiveload.train.job import eval_indices

    manifest = tiny_dataset(tmp_path / "data", TINY_SHAPES, 24)
    evaluated = set(eval_indices(load_manifest(manifest), 4))
    row = max(set(range(24)) - evaluated)  # not read before training starts
    gone = tmp_path / "data" / "latents" / f"{row}{'.safetensors' if row % 2 == 0 else '.pt'}"
    gone.write_bytes(b"not a tensor file")
    out = tmp_path / "out"
    proc = run_cli("train", "--manifest", manifest, "--backend", "eager", "--profile-every", "0", "--quiet",
                   "--dist-timeout", "20", "--out", out, nproc=2, timeout=200)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"could not load its batch: {manifest}: row {row + 1}: latent file {gone}: cannot read it" in proc.stdout
    (run,) = _results(out)["runs"]
    assert run["status"] == "failed" and f"row {row + 1}" in run["error"]
    assert run["steps"] == len(run["history"]) < run["steps_per_epoch"]
    seen = {i for h in run["history"] for rank in h["indices"] for i in rank}
    assert row not in seen


@pytest.mark.slow
def test_a_failed_baseline_is_reported_beside_the_run(tmp_path, run_cli):
    """The baseline stops at warm-up with non-finite time-embedding gradients: the job still prints
    both runs side by side (the baseline's status and reason), records them in results.json and
    exits 0, since the run asked for succeeded."""
    out = tmp_path / "out"
    proc = run_cli("train", "--model", "faulty_model:nan_time_embedding_in_second_model", "--backend", "eager",
                   "--baseline", "--calibration", "anchors-wan1.3b", "--m-mem", "2100", "--samples", "32",
                   "--steps", "2", "--profile-every", "0", "--quiet", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    main, baseline = _results(out)["runs"]
    assert main["name"] == "eager+dual" and main["status"] == "ok" and main["steps"] == 2
    assert baseline["name"] == "baseline:eager+equal_token" and baseline["status"] == "failed"
    assert baseline["error"].startswith("warm-up step 0: rank 0 got a non-finite loss or gradient")
    assert "non-finite gradients in 4 parameter(s): time_embedding.0.weight" in baseline["error"]
    assert baseline["steps"] == 0 and baseline["hint"] is None  # eager, not Inductor: no compiler hint
    lines = proc.stdout.splitlines()
    (status,) = [line for line in lines if line.startswith("status ")]
    assert status.split()[1:] == ["ok", "failed"]
    assert ("speedup (tokens/s, eager+dual / baseline:eager+equal_token): - (baseline:eager+equal_token failed)"
            in lines)
    assert f"baseline:eager+equal_token: {baseline['error']}" in proc.stdout
    assert "results:" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ltx_geometry_in_train_and_calibrate(tmp_path, run_cli):
    """--vae-stride 8,32,32 --patch-size 1,1,1 (LTX-Video): token counts by hand, recorded in the
    calibration and results; calibrate measures the same shapes."""
    manifest = tmp_path / "m.csv"
    # (F-1)//8 + 1, H//32, W//32: 17x128x192 -> 3x4x6 (S = 72), 9x128x128 -> 2x4x4 (32), 1x64x96 -> 1x2x3 (6)
    manifest.write_text("num_frames,height,width\n" + "17,128,192\n9,128,128\n1,64,96\n" * 4)
    geometry = ("--vae-stride", "8,32,32", "--patch-size", "1,1,1", "--downscale", "1")
    out = tmp_path / "out"
    proc = run_cli("train", "--manifest", manifest, *geometry, "--backend", "eager", "--steps", "3", "--quiet",
                   "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(out)
    assert (results["corpus"]["seq_len_min"], results["corpus"]["seq_len_max"]) == (6, 72)
    assert results["corpus"]["vae_stride"] == [8, 32, 32] and results["corpus"]["patch_size"] == [1, 1, 1]
    (run,) = results["runs"]
    assert run["model"]["patch_size"] == [1, 1, 1] and {s for h in run["history"] for s in h["seq_lens"]} <= {6, 32, 72}
    settings = json.loads((out / "calibration.json").read_text())["settings"]
    assert settings["vae_stride"] == [8, 32, 32] and settings["patch_size"] == [1, 1, 1] and settings["downscale"] == 1
    cal = tmp_path / "cal.json"
    proc = run_cli("calibrate", "--manifest", manifest, *geometry, "--backend", "eager", "--shapes", "3",
                   "--batch-sizes", "1", "--warmup", "0", "--repeats", "1", "--out", cal)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads(cal.read_text())["points"]
    assert sorted((p["seq_len"], tuple(p["latent_shape"])) for p in points) == [
        (6, (1, 2, 3)), (32, (2, 4, 4)), (72, (3, 4, 6))]


@pytest.mark.slow
def test_a_corpus_of_one_bucket_shape_calibrates_and_trains(tmp_path, run_cli):
    """One shape under the token cap gave 2 calibration points (B = 1, 2) and no cost model; the quick
    calibration now times B = 1, 2 and 4 and the job trains."""
    manifest = tmp_path / "one.csv"
    manifest.write_text("num_frames,height,width\n1,256,256\n1,256,256\n1,256,256\n")
    out = tmp_path / "out"
    proc = run_cli("train", "--manifest", manifest, "--steps", "2", "--backend", "eager", "--quiet", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads((out / "calibration.json").read_text())["points"]
    assert [p["batch_size"] for p in points] == [1, 2, 4]
    assert _results(out)["runs"][0]["steps"] == 2
