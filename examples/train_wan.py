r"""Train diffusers' Wan 2.1 transformer with AdaptiveLoad: fused AdaLN modulation + cost-balanced buckets.

    pip install . diffusers   # in a clone of this repository; diffusers has WanTransformer3DModel

Run from a checkout of the repository. CPU, 2 processes (gloo), a tiny model on the 28-sample
manifest next to this file, with the aot_eager inner compiler (Inductor's CPU LayerNorm backward
fails on diffusers' transposed patchify, pytorch/pytorch#185702):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_wan.py --model tiny \
        --manifest examples/tiny_manifest.csv --m-mem 64 --inner aot_eager --steps 6 --out runs/tiny
    # later: the same command with a larger --steps and --resume continues from the newest checkpoint

GPU, N processes (nccl, one GPU each, bf16 autocast, Inductor inside the adaptiveload backend), Wan
2.1 1.3B cut to the 10 layers that the built-in calibration "anchors-wan1.3b" measured, on the
reference image/video mix (one H200, N = 1: 88 GiB peak):

    torchrun --standalone --nproc-per-node 8 examples/train_wan.py --model wan1.3b --num-layers 10 \
        --samples 20000 --memory-budget-gb 120 --workers 4 --steps 1000 --checkpoint-every 200 --out runs/wan
    # all 30 layers: calibrate them first, then plan with that here (or once with `adaptiveload plan`):
    adaptiveload calibrate --model adaptiveload.train.diffusers_wan:wan_1_3b --out calib.json
    torchrun --standalone --nproc-per-node 8 examples/train_wan.py --model wan1.3b --calibration calib.json ...

Data: one manifest row per sample with its size (num_frames,height,width, or latent_t,latent_h,latent_w)
and, for real training, latent_path,text_path: files saved with torch.save holding the VAE latents
[C, T, H, W] of exactly that latent size and the padded text embeddings [text_len, text_dim]. Without
file columns (as in tiny_manifest.csv and the reference mix) the latents and embeddings are random.

Outputs under --out: plan.json; losses.jsonl, a line per step (the mean loss over all ranks' samples,
their number, rank 0's latent shape); checkpoints/step_NNNNNN/ with the DCP shards of model and AdamW
and train_state.json (the step and the sampler's resume state), written last: a folder without it
is incomplete and skipped. Each rank's loss is weighted by its share of the step's samples, so every
sample counts the same although ranks get batches of different sizes.
"""
import argparse
import json
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from adaptiveload.sched import DualConstraintBucketSampler, Plan, load_calibration, load_manifest, make_plan, reference_mix
from adaptiveload.train.step import flow_matching_loss

MODELS = {  # WanTransformer3DModel arguments; text_len is what the text encoder pads prompts to
    "wan1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, patch_size=(1, 2, 2), text_len=512),
    "tiny": dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2, in_channels=4,
                 out_channels=4, text_dim=32, freq_dim=32, patch_size=(1, 2, 2), text_len=8),
}


# FSDP2 warns that the root returns a view (diffusers' unpatchify); harmless here: nothing modifies it in place
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def seed_of(*keys) -> int:
    """A 64-bit seed from integers (numpy's SeedSequence mixes them; no collisions like a + b)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0])


class LatentDataset(torch.utils.data.Dataset):
    """Sample i: latents [C, *manifest.latent_shapes[i]] and text embeddings [L, text_dim], loaded from the
    manifest's latent_path / text_path files (tensors saved with torch.save) or, without them, random."""

    def __init__(self, manifest, channels, text_len, text_dim, seed):
        self.manifest, self.channels, self.text_shape, self.seed = manifest, channels, (text_len, text_dim), seed

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        shape = (self.channels, *self.manifest.latent_shapes[i].tolist())
        if self.manifest.latent_paths is None:  # synthetic data, the same for a sample index every time
            g = torch.Generator().manual_seed(seed_of(self.seed, i))
            return {"latents": torch.randn(shape, generator=g), "context": torch.randn(self.text_shape, generator=g)}
        paths = self.manifest.latent_paths[i], self.manifest.text_paths[i]
        latents, context = (torch.load(path, weights_only=True).float() for path in paths)
        if latents.shape != shape or context.shape != self.text_shape:
            raise ValueError(f"sample {i}: {paths[0]} holds {list(latents.shape)} and {paths[1]} "
                             f"{list(context.shape)}; the manifest and the model expect {list(shape)} and "
                             f"{list(self.text_shape)}")
        return {"latents": latents, "context": context}


def contiguous_dynamic(module, args):
    """Block pre-hook: contiguous inputs with all but the channel dim dynamic, so every block and bucket
    shape reuses one compiled graph (the first block otherwise gets a transposed view of the patchify)."""
    def prep(a):
        if isinstance(a, (tuple, list)):
            return type(a)(prep(x) for x in a)
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            a = a.contiguous()
            torch._dynamo.maybe_mark_dynamic(a, list(range(a.dim() - 1)))
        return a
    return prep(tuple(args))


def get_plan(args, manifest, world_size) -> Plan:
    """The --plan file, checked against this job, or a plan made here for the manifest and world size."""
    if args.plan:
        plan = Plan.load(args.plan)
        if plan.world_size != world_size:
            raise SystemExit(f"--plan {args.plan} was made for world size {plan.world_size}, this job runs "
                             f"{world_size} processes: make a plan for {world_size} (adaptiveload plan --world-size "
                             f"{world_size} ...) or run with --nproc-per-node {plan.world_size}")
        known = {tuple(b["key"]) for b in plan.buckets + plan.dropped}
        missing = sorted({tuple(k) for k in manifest.latent_shapes.tolist()} - known)
        if missing:
            raise SystemExit(f"--plan {args.plan} was made for another corpus: latent shapes {missing[:5]} of "
                             f"the manifest are not in it")
        return plan
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * 2**30
    return make_plan(manifest, load_calibration(args.calibration), world_size, memory_budget_bytes=budget,
                     m_mem=args.m_mem, drop_oversized=args.drop_oversized, policy="dual")


def checked(kind, positive=True):
    """argparse type: a number of ``kind`` that is > 0 (>= 0 with positive=False)."""
    def parse(text):
        value = kind(text)
        if not (value > 0 if positive else value >= 0):
            raise argparse.ArgumentTypeError(f"must be {'positive' if positive else '>= 0'}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


def newest_checkpoint(folder):
    done = [d for d in sorted(os.listdir(folder)) if os.path.exists(os.path.join(folder, d, "train_state.json"))] \
        if os.path.isdir(folder) else []
    return os.path.join(folder, done[-1]) if done else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="wan1.3b", help="size preset")
    p.add_argument("--num-layers", type=checked(int), help="override the preset's number of transformer blocks")
    p.add_argument("--manifest", help="CSV / JSONL / Parquet with num_frames,height,width per sample "
                   "(default: the reference mix of --samples samples)")
    p.add_argument("--samples", type=checked(int), default=2000, help="reference-mix samples without --manifest")
    p.add_argument("--plan", help="a plan JSON (adaptiveload plan) instead of planning here")
    p.add_argument("--calibration", default="anchors-wan1.3b", help="built-in name or calibration JSON to plan with")
    p.add_argument("--m-mem", type=checked(int), help="fixed tokens per batch instead of --memory-budget-gb")
    p.add_argument("--memory-budget-gb", type=checked(float), help="GPU memory to plan for (default: calibration's)")
    p.add_argument("--drop-oversized", action="store_true", help="skip samples longer than the memory budget")
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="compiler behind the adaptiveload backend (aot_eager on CPU)")
    p.add_argument("--steps", type=checked(int), default=100, help="train until this global step")
    p.add_argument("--lr", type=checked(float), default=1e-4)
    p.add_argument("--workers", type=checked(int, positive=False), default=2, help="DataLoader workers per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=checked(int, positive=False), default=0,
                   help="checkpoint every N steps (and always at the last step)")
    p.add_argument("--out", default="runs/wan")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("start it with torchrun: torchrun --standalone --nproc-per-node N examples/train_wan.py ...")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()

    manifest = load_manifest(args.manifest) if args.manifest else reference_mix(args.samples, seed=args.seed)
    if manifest.latent_shapes is None:
        raise SystemExit(f"{args.manifest}: the manifest needs sizes (num_frames,height,width or "
                         f"latent_t,latent_h,latent_w), not only seq_len")
    plan = get_plan(args, manifest, world)
    sampler = DualConstraintBucketSampler.from_plan(plan, manifest.latent_shapes, num_replicas=world, rank=rank,
                                                    seed=args.seed)
    config = {**MODELS[args.model], **({"num_layers": args.num_layers} if args.num_layers else {})}
    text_len = config.pop("text_len")
    if tuple(config["patch_size"]) != tuple(manifest.patch_size):
        raise SystemExit(f"manifest patch size {manifest.patch_size} differs from the model's {config['patch_size']}")
    dataset = LatentDataset(manifest, config["in_channels"], text_len, config["text_dim"], args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers,
                                         pin_memory=cuda, persistent_workers=args.workers > 0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        plan.save(os.path.join(args.out, "plan.json"))
        print(plan.format_table(), flush=True)

    from diffusers import WanTransformer3DModel
    torch.manual_seed(args.seed)  # same initial weights on every rank (FSDP2 shards them as they are)
    model = WanTransformer3DModel(**config).to(device).train()
    # Regional compilation, then FSDP2: each block's forward is compiled (one graph shared by all
    # blocks, FSDP2's all-gather hooks stay outside it), and sharded; the root last.
    compile_options = {"backend": "adaptiveload", "options": {"inner": args.inner}}
    for block in model.blocks:
        block.register_forward_pre_hook(contiguous_dynamic)
        block.forward = torch.compile(block.forward, **compile_options)
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step, ckpt_dir = 0, os.path.join(args.out, "checkpoints")
    if args.resume:
        path = newest_checkpoint(ckpt_dir)
        if path is None:
            raise SystemExit(f"--resume: no complete checkpoint in {ckpt_dir}")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        with open(os.path.join(path, "train_state.json")) as f:
            train_state = json.load(f)
        sampler.load_state_dict(train_state["sampler"])  # raises on another world size, seed or corpus
        step = train_state["step"]
        if rank == 0:
            print(f"resumed from {path} at step {step}", flush=True)

    def save(consumed_steps):
        path = os.path.join(ckpt_dir, f"step_{step:06d}")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dist.barrier()  # every rank's shards are written before the folder is marked complete
        if rank == 0:
            with open(os.path.join(path, "train_state.json.tmp"), "w") as f:
                json.dump({"step": step, "sampler": sampler.state_dict(consumed_steps=consumed_steps)}, f)
            os.replace(os.path.join(path, "train_state.json.tmp"), os.path.join(path, "train_state.json"))

    def call(x, t, c):
        return model(x, t, c, return_dict=False)[0]

    epoch = sampler.epoch
    while step < args.steps:
        sampler.set_epoch(epoch)  # keeps a restored resume point of this epoch
        for i, batch in enumerate(loader, start=sampler.resume_step):
            latents = batch["latents"].to(device, non_blocking=True)
            context = batch["context"].to(device, non_blocking=True)
            g = torch.Generator(device).manual_seed(seed_of(args.seed, step, rank))  # noise depends on the step only
            noise = torch.randn(latents.shape, generator=g, device=device)
            sigma = torch.sigmoid(torch.randn(len(latents), generator=g, device=device))  # logit-normal noise level
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss_sum = flow_matching_loss(call, latents, context, noise, sigma).sum()
            totals = torch.stack([loss_sum.detach(), torch.tensor(float(len(latents)), device=device)])
            dist.all_reduce(totals)  # [sum of all ranks' sample losses, samples in the step]
            # FSDP2 averages gradients over ranks: world/N_global makes it the mean over the step's samples
            (loss_sum * (world / totals[1])).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0:
                record = {"step": step, "epoch": epoch, "loss": (totals[0] / totals[1]).item(),
                          "samples": int(totals[1]), "rank0_latent_shape": list(latents.shape[2:])}
                print(json.dumps(record), flush=True)
                with open(os.path.join(args.out, "losses.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
            if step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0):
                save(consumed_steps=i + 1)
            if step >= args.steps:
                break
        else:
            epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
