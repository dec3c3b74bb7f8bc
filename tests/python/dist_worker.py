"""One rank of test_torch_dist's runs (started by torchrun, or directly for one rank): a small HF
model trained through tiermem.torch with the global batch split evenly over the ranks; rank 0
writes the per-step global losses (the mean of the ranks' losses) as JSON, and with --resume each
rank's max RSS (getrusage) before and after load_checkpoint (or, with --state-dict, the
optimizer's load_state_dict)."""

import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import VOCAB, build, ds_config, hf_or_skip  # noqa: E402

import tiermem.torch as tt  # noqa: E402

GLOBAL = 6  # sequences per step: divides by 1, 2 and 3 ranks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="gpt2")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--offload", default="nvme")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--swap", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-at", type=int, default=0, help="save a checkpoint to --ckpt after this step")
    ap.add_argument("--resume", action="store_true", help="load --ckpt first, then train --steps")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--state-dict", action="store_true",
                    help="save and resume through optimizer.state_dict() / load_state_dict() (torch.save at --ckpt)")
    ap.add_argument("--load-model-state", action="store_true",
                    help="after initialize, every rank loads the state dict of another build (seed 5) into the model")
    a = ap.parse_args()
    hf_or_skip()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = ds_config(a.swap, a.offload, stage=a.stage, clip=1.0)
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL // world
    if a.offload == "nvme":
        cfg["tiermem"] = {"host_budget_bytes": "2MiB", "device_budget_bytes": "512KiB"}
    model = build(a.kind)
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0  # no RNG across ranks
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if os.environ.get("TIERMEM_TEST_RANK1_ORDER") and int(os.environ.get("RANK", "0")) == 1:
        # Rank-dependent control flow: on rank 1 the first block's MLP runs before its attention.
        block = model.transformer.h[0]
        block.attn.register_forward_pre_hook(lambda m, a: block.mlp(torch.zeros(1, 1, model.config.n_embd)))
    engine, optimizer, *_ = tt.initialize(model=model, config=cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(7)
    losses = []
    first = 0
    load_rss = None
    if a.resume:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if a.state_dict:  # every rank loads the same file: a collective
            optimizer.load_state_dict(torch.load(a.ckpt, weights_only=True))
        else:
            engine.load_checkpoint(a.ckpt)
        load_rss = [before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
        first = engine.global_steps
        for _ in range(first):  # the data stream continues where the checkpoint left it
            torch.randint(0, VOCAB, (GLOBAL, 16), generator=g)
    loaded_off = None
    if a.load_model_state:  # every rank: model.load_state_dict reaches the engine's master and working copy
        other = build(a.kind, seed=5)
        model.load_state_dict(other.state_dict())
        from tiermem.torch.utils import safe_get_full_fp32_param
        loaded_off = max(float((safe_get_full_fp32_param(p) - q.detach()).abs().max())
                         for p, q in zip(model.parameters(), other.parameters()))
    kill_at = int(os.environ.get("TIERMEM_TEST_KILL_RANK1_AT_STEP", "0"))
    for step in range(first, first + a.steps):
        if kill_at and rank == 1 and step + 1 == kill_at:
            os.kill(os.getpid(), 9)  # as a crashed or OOM-killed rank: no clean-up at all
        batch = torch.randint(0, VOCAB, (GLOBAL, 16), generator=g)
        mine = batch.chunk(world)[rank]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
        if a.save_at and step + 1 == a.save_at:
            if a.state_dict:  # every rank calls state_dict() (a collective); rank 0 saves it
                sd = optimizer.state_dict()
                if rank == 0:
                    torch.save(sd, a.ckpt)
            else:
                engine.save_checkpoint(a.ckpt)
    stats = engine.stats()
    state_bytes = stats["optimizer_state_bytes"]
    engine.close()
    rss = [load_rss]
    offs = [loaded_off]
    if world > 1:
        rss = [None] * world
        dist.all_gather_object(rss, load_rss)
        offs = [None] * world
        dist.all_gather_object(offs, loaded_off)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"losses": losses, "world": world, "load_rss": rss, "loaded_off": offs, "optimizer_state_bytes": state_bytes,
                       "all_gather_calls": stats["all_gather_calls"],
                       "all_gathers_prefetched": stats["all_gathers_prefetched"],
                       "comm_blocked_s": stats.get("comm_blocked_s", 0.0)}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
