#!/usr/bin/env python3
# ZeRO-3 with NVMe offload for a Hugging Face model, through tiermem.torch.initialize (DeepSpeed's
# call shapes; the C++ engine pages parameters, gradients and optimizer state across tiers).
#
# Run from the repo root, after `make test-python` (it makes ~/.cache/tiermem/venv and installs
# tiermem into it):
#
#   ~/.cache/tiermem/venv/bin/python examples/torch/train_hf.py --model llama --steps 20
#   ~/.cache/tiermem/venv/bin/python examples/torch/train_hf.py --config examples/torch/ds_config.json
#   ~/.cache/tiermem/venv/bin/torchrun --nproc-per-node 2 examples/torch/train_hf.py   # 2 ranks (gloo)
#
# The model is built from a transformers config (nothing is downloaded) and trained on the text of
# Debian's `fortunes` package (/usr/share/games/fortunes) as byte-level tokens. Without --config
# the run uses a built-in ZeRO-3 config with parameters and optimizer state on NVMe under
# --nvme-dir. Flags given explicitly (--batch, --lr, --nvme-dir) override the config's values.
# Environment: TIERMEM_EXAMPLE_STEPS=N overrides --steps (the tests shorten runs with it).
import argparse
import json
import os
import pathlib
import resource
import sys
import time

CORPUS = "/usr/share/games/fortunes"
MiB = 1 << 20


def builtin_config(nvme_dir: str) -> dict:
    offload = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload),
                                  "stage3_param_persistence_threshold": 0},
            "tiermem": {"host_budget_bytes": "8MiB", "device_budget_bytes": "4MiB"}}


def no_duplicates(pairs):  # DeepSpeed refuses a key given twice; json.load would keep the last one
    keys = [k for k, _ in pairs]
    dup = [k for k in keys if keys.count(k) > 1]
    if dup:
        raise ValueError(f"key {dup[0]!r} is given twice in the same object")
    return dict(pairs)


def load_config(args) -> dict:
    if args.config is None:
        cfg = builtin_config(args.nvme_dir or "./tiermem-swap")
    else:
        try:
            with open(args.config, encoding="utf-8") as f:
                cfg = json.load(f, object_pairs_hook=no_duplicates)
        except OSError as e:
            sys.exit(f"train_hf.py: error: cannot read --config {args.config}: {e.strerror}")
        except ValueError as e:
            sys.exit(f"train_hf.py: error: --config {args.config} is not plain JSON (no comments): {e}")
        if not isinstance(cfg, dict):
            sys.exit(f"train_hf.py: error: --config {args.config} must hold a JSON object")
    for key in ("offload_param", "offload_optimizer"):  # an explicit --nvme-dir replaces the config's nvme_path
        off = (cfg.get("zero_optimization") or {}).get(key)
        if args.nvme_dir is not None and isinstance(off, dict) and off.get("device") == "nvme":
            off["nvme_path"] = args.nvme_dir
    if args.batch is not None or cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = args.batch or 4
        if cfg.get("train_batch_size") in ("auto", None) or args.batch is not None:
            cfg.pop("train_batch_size", None)  # derived: micro-batch x accumulation
    if args.lr is not None:
        cfg.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = args.lr
        if "warmup_max_lr" in ((cfg.get("scheduler") or {}).get("params") or {}):
            cfg["scheduler"]["params"]["warmup_max_lr"] = args.lr
    return cfg


def load_corpus(path: str) -> bytes:
    """Byte-level tokens of every text file under `path` (or of the file `path`), in name order."""
    if not os.path.exists(path):
        sys.exit(f"train_hf.py: error: corpus {path} not found: install it with `apt-get install fortunes` "
                 "(Debian's fortunes package), or pass --data FILE_OR_DIR")
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(r, n) for r, _, names in os.walk(path) for n in names if not n.endswith((".dat", ".u8")))
    texts = [pathlib.Path(name).read_bytes() for name in files]
    return b"".join(t for t in texts if b"\0" not in t[:4096])  # text files only


def build_model(args):
    import transformers
    transformers.logging.set_verbosity_error()
    if args.model == "gpt2":
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                      vocab_size=args.vocab, n_positions=args.seq_len)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                   num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                                   vocab_size=args.vocab, max_position_embeddings=args.seq_len)
    return transformers.LlamaForCausalLM(cfg)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def parse_args():
    ap = argparse.ArgumentParser(description="Train a Hugging Face GPT-2 or Llama (built from a config, no download) "
                                 "with ZeRO-3 through tiermem.torch, on the fortunes corpus as byte tokens.")
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2", help="architecture [gpt2]")
    ap.add_argument("--layers", type=positive, default=4, help="transformer blocks [4]")
    ap.add_argument("--hidden", type=positive, default=128, help="hidden size [128]")
    ap.add_argument("--heads", type=positive, default=4, help="attention heads; must divide --hidden [4]")
    ap.add_argument("--vocab", type=positive, default=256, help="vocabulary, at least 256 for byte tokens [256]")
    ap.add_argument("--seq-len", type=positive, default=128, help="tokens per sequence (= positions) [128]")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps [20]; TIERMEM_EXAMPLE_STEPS overrides it")
    ap.add_argument("--batch", type=positive, default=None, help="micro-batch (train_micro_batch_size_per_gpu) "
                    "[the config's, else 4]")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate [the config's, else 1e-3]")
    ap.add_argument("--config", default=None, help="DeepSpeed ds_config.json [built in: ZeRO-3, NVMe offloads]")
    ap.add_argument("--nvme-dir", default=None, help="swap directory for the NVMe offloads [./tiermem-swap, or the "
                    "config's nvme_path]")
    ap.add_argument("--data", default=CORPUS, help=f"text file or directory [{CORPUS}]")
    ap.add_argument("--zero-init", action="store_true", help="build the model under tiermem.torch.zero.Init")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the batches [0]")
    args = ap.parse_args()
    env = os.environ.get("TIERMEM_EXAMPLE_STEPS")
    if env is not None:
        if not env.isdigit():
            ap.error(f"TIERMEM_EXAMPLE_STEPS={env!r} must be a whole number, 0 or more")
        args.steps = int(env)
    if args.steps < 0:
        ap.error(f"--steps {args.steps} must be 0 or more")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.vocab < 256:
        ap.error(f"--vocab {args.vocab}: byte-level tokens need at least 256")
    if args.lr is not None and not args.lr > 0:
        ap.error(f"--lr {args.lr} must be above 0")
    return args


def main() -> None:
    args = parse_args()
    cfg = load_config(args)
    text = load_corpus(args.data)
    if len(text) <= args.seq_len + 1:
        sys.exit(f"train_hf.py: error: {args.data} holds {len(text)} tokens, fewer than --seq-len {args.seq_len} + 2")
    # Imported once the flags, config and corpus are checked, so that a mistake is reported at once.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's and tiermem's OpenMP threads: no spinning
    import torch
    import tiermem.torch
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    torch.manual_seed(args.seed)
    with tiermem.torch.zero.Init(config=cfg, enabled=args.zero_init):  # enabled=False: a plain build
        model = build_model(args)
    try:
        engine, optimizer, _, lr_scheduler = tiermem.torch.initialize(
            model=model, model_parameters=model.parameters(), config=cfg)
    except (ValueError, TypeError, MemoryError, NotImplementedError, OSError) as e:  # a refused start
        sys.exit(f"train_hf.py: error{f' (--config {args.config})' if args.config else ''}: {e}")
    batch, n_params = engine.train_micro_batch_size_per_gpu, sum(p.numel() for p in engine.parameters())
    print(f"{args.model}: {n_params:,} parameters; corpus {args.data}: {len(tokens):,} tokens; "
          f"{args.steps} steps of {engine.gradient_accumulation_steps} x {batch} x {args.seq_len} tokens")
    gen = torch.Generator().manual_seed(args.seed + int(os.environ.get("RANK", "0")))  # each rank its own batches
    engine.train()
    losses, seen, t_start = [], 0, time.perf_counter()
    st = engine.stats()
    for step in range(1, args.steps + 1):
        t0, lr = time.perf_counter(), engine.get_lr()[0]  # the lr this step runs at
        for _ in range(engine.gradient_accumulation_steps):
            starts = torch.randint(0, len(tokens) - args.seq_len, (batch,), generator=gen).tolist()
            ids = torch.stack([tokens[s:s + args.seq_len] for s in starts])
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            seen += ids.numel()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        st, last = engine.stats(), st
        print(f"step {step}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  "
              f"{engine.gradient_accumulation_steps * ids.numel() / dt:,.0f} tokens/s  nvme read "
              f"{(st['nvme_read_bytes'] - last['nvme_read_bytes']) / MiB:.1f} MiB written "
              f"{(st['nvme_written_bytes'] - last['nvme_written_bytes']) / MiB:.1f} MiB  host peak "
              f"{st['host_pool_peak_bytes'] / MiB:.1f} MiB  device peak {st['device_peak_bytes'] / MiB:.1f} MiB",
              flush=True)
    seconds = time.perf_counter() - t_start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    state = (st["optimizer_state_bytes"] + st["gradient_bytes"] + st["param_store_bytes"]) / MiB
    print(f"summary: {len(losses)} steps in {seconds:.1f} s, {seen / max(seconds, 1e-9):,.0f} tokens/s; loss "
          + (f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "n/a (no steps)")
          + f"; params {st['param_home']}, optimizer {st['optimizer_home']}, gradients {st['gradient_home']}; "
          f"state {state:.1f} MiB; nvme read {st['nvme_read_bytes'] / MiB:.1f} MiB, written "
          f"{st['nvme_written_bytes'] / MiB:.1f} MiB; host peak {st['host_pool_peak_bytes'] / MiB:.1f} of "
          f"{st['host_budget_bytes'] / MiB:.1f} MiB, device peak {st['device_peak_bytes'] / MiB:.1f} of "
          f"{st['device_budget_bytes'] / MiB:.1f} MiB; max RSS {rss:.0f} MiB")
    engine.close()
    if not all(torch.isfinite(torch.tensor(losses))):
        sys.exit("train_hf.py: error: the loss is not finite")


if __name__ == "__main__":
    main()
