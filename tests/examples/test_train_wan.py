"""examples/train_wan.py end to end on CPU: 2 gloo processes, FSDP2, the adaptiveload backend with the
aot_eager inner compiler, DataLoader workers, DCP checkpoints and an exact resume.

Three launches of the script: an uninterrupted reference run of 4 steps, a run stopped after 2 steps,
and its resume to step 4. The reference's first two losses are also recomputed here, in one process
without FSDP, compile or the library's loss: the tiny diffusers model from the same seed, the
planned batches of both ranks, x_t = (1 - sigma)*x0 + sigma*noise against noise - x0, one
mean over all the step's samples, and one AdamW step. The plan checks and the dataset's file reading
run in this process (not slow).
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_wan.py"
LR = 1e-2  # large, so that a wrong weighting of the ranks' gradients changes step 2's loss visibly
COMMON = ["--model", "tiny", "--manifest", str(ROOT / "examples" / "tiny_manifest.csv"), "--m-mem", "64",
          "--inner", "aot_eager", "--workers", "1", "--lr", str(LR), "--seed", "3"]


def torchrun(*args):
    """The example under torchrun, 2 processes (the CPU command of its docstring); returns its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *COMMON, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def losses(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_wan")
    ref, cut = base / "reference", base / "interrupted"
    torchrun("--steps", "4", "--out", str(ref))
    torchrun("--steps", "2", "--out", str(cut))
    first = losses(cut)
    resumed_stdout = torchrun("--steps", "4", "--resume", "--out", str(cut))
    return {"ref": ref, "cut": cut, "ref_losses": losses(ref), "cut_losses": first, "all_losses": losses(cut),
            "resumed_stdout": resumed_stdout}


@pytest.mark.slow
def test_resume_after_step_2_continues_exactly(runs):
    ref, before, after = runs["ref_losses"], runs["cut_losses"], runs["all_losses"]
    assert sorted(ref) == [1, 2, 3, 4] and sorted(before) == [1, 2] and sorted(after) == [1, 2, 3, 4]
    assert "resumed from" in runs["resumed_stdout"] and "at step 2" in runs["resumed_stdout"]
    state = json.loads((runs["cut"] / "checkpoints" / "step_000002" / "train_state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["consumed_steps"] == 2 and state["sampler"]["epoch"] == 0
    assert [ref[s]["epoch"] for s in (1, 2, 3, 4)] == [0, 0, 0, 1]  # resumed mid-epoch, then into the next
    for step in (1, 2):  # the same run until the interruption
        assert before[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-6)
    diffs = {}
    for step in (3, 4):  # after the resume: the same batches (shape, size) and the same loss
        assert (after[step]["samples"], after[step]["epoch"], after[step]["rank0_latent_shape"]) == \
            (ref[step]["samples"], ref[step]["epoch"], ref[step]["rank0_latent_shape"])
        diffs[step] = abs(after[step]["loss"] - ref[step]["loss"])
        assert diffs[step] <= 1e-6, diffs
    print("resume loss differences:", diffs)
    # the losses move from step to step, so equal values above are not a constant
    assert len({round(r["loss"], 6) for r in ref.values()}) == 4


def _load_example():
    spec = importlib.util.spec_from_file_location("train_wan_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_first_two_steps_match_a_single_process_reference(runs):
    """The same two global steps in one process: the planned batches of both ranks, each sample's
    loss weighted equally (ranks hold different batch sizes), eager diffusers model, plain AdamW.
    Averaging the two ranks' mean losses instead moves step 2's loss by about 2% (measured), far
    outside the tolerance."""
    from diffusers import WanTransformer3DModel

    from adaptiveload.sched import DualConstraintBucketSampler, Plan, load_manifest

    example = _load_example()
    seed, world = 3, 2
    plan = Plan.load(runs["ref"] / "plan.json")
    manifest = load_manifest(str(ROOT / "examples" / "tiny_manifest.csv"))
    samplers = [DualConstraintBucketSampler.from_plan(plan, manifest.latent_shapes, num_replicas=world, rank=r,
                                                      seed=seed) for r in range(world)]
    batches = [list(iter(s))[:2] for s in samplers]  # [rank][step] -> sample indices
    config = dict(example.MODELS["tiny"])
    text_len = config.pop("text_len")
    data = example.LatentDataset(manifest, config["in_channels"], text_len, config["text_dim"], seed)
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sizes = [len(batches[0][0]), len(batches[1][0])]
    assert sizes[0] != sizes[1] or len(batches[0][1]) != len(batches[1][1])  # unequal batches are exercised
    for step in range(2):
        per_sample = []
        for rank in range(world):
            idx = batches[rank][step]
            x0 = torch.stack([data[i]["latents"] for i in idx])
            context = torch.stack([data[i]["context"] for i in idx])
            g = torch.Generator().manual_seed(example.seed_of(seed, step, rank))
            noise = torch.randn(x0.shape, generator=g)
            sigma = torch.sigmoid(torch.randn(len(idx), generator=g))
            s = sigma.view(-1, 1, 1, 1, 1)
            pred = model((1 - s) * x0 + s * noise, 1000 * sigma, context, return_dict=False)[0]
            per_sample.append(((pred - (noise - x0)) ** 2).mean(dim=(1, 2, 3, 4)))
        loss = torch.cat(per_sample).mean()
        logged = runs["ref_losses"][step + 1]
        assert logged["samples"] == sum(len(b[step]) for b in batches)
        assert logged["loss"] == pytest.approx(loss.item(), rel=2e-5), step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def test_a_plan_for_another_world_size_or_corpus_is_refused(tmp_path):
    """The example's plan check, called as main() calls it (no processes needed to fail)."""
    from adaptiveload.sched import load_manifest, make_plan
    from adaptiveload.sched.presets import load_calibration

    example = _load_example()
    manifest = load_manifest(str(ROOT / "examples" / "tiny_manifest.csv"))
    make_plan(manifest, load_calibration("anchors-wan1.3b"), 2, m_mem=64, policy="dual").save(tmp_path / "plan.json")
    args = argparse.Namespace(plan=str(tmp_path / "plan.json"))
    assert example.get_plan(args, manifest, 2).world_size == 2
    with pytest.raises(SystemExit, match=r"was made for world size 2, this job runs 4 processes"):
        example.get_plan(args, manifest, 4)
    other = dataclasses.replace(manifest, latent_shapes=manifest.latent_shapes * [1, 2, 1])  # twice the height
    with pytest.raises(SystemExit, match=r"made for another corpus: latent shapes \[\(1, 8, 4\)"):
        example.get_plan(args, other, 2)


def test_the_dataset_reads_the_manifest_files_and_checks_their_shapes(tmp_path):
    from adaptiveload.sched import load_manifest

    example = _load_example()
    tensors = {"a.pt": torch.randn(4, 2, 4, 6), "a_text.pt": torch.randn(8, 32),
               "b.pt": torch.randn(4, 1, 4, 4), "b_text.pt": torch.randn(8, 32)}
    for name, tensor in tensors.items():
        torch.save(tensor, tmp_path / name)
    (tmp_path / "m.csv").write_text("latent_path,text_path,latent_t,latent_h,latent_w\n"
                                    "a.pt,a_text.pt,2,4,6\nb.pt,b_text.pt,2,4,4\n")  # b's file has T = 1
    data = example.LatentDataset(load_manifest(str(tmp_path / "m.csv")), 4, 8, 32, seed=0)
    assert len(data) == 2
    torch.testing.assert_close(data[0]["latents"], tensors["a.pt"], rtol=0, atol=0)
    torch.testing.assert_close(data[0]["context"], tensors["a_text.pt"], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"sample 1: .*b.pt holds \[4, 1, 4, 4\].*expect \[4, 2, 4, 4\] and \[8, 32\]"):
        data[1]
