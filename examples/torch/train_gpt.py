#!/usr/bin/env python3
"""A small GPT trained with tiermem.torch.NVMeAdamW: the optimizer state lives on NVMe.

Build and run (from the repo root; make test-python makes the environment and installs tiermem):

    make test-python            # or: scripts/setup.sh --python && $TIERMEM_VENV/bin/pip install .
    ~/.cache/tiermem/venv/bin/python examples/torch/train_gpt.py --steps 50 --swap-dir /tmp/tm-swap

The corpus is tiermem-train's default (/usr/share/games/fortunes, Debian's `fortunes` package,
every text file joined, byte-level tokens); --data takes another text file or directory. The one
line that differs from a plain PyTorch script is the optimizer's:

    opt = torch.optim.AdamW(model.parameters(), lr=...)                          # before
    opt = NVMeAdamW(model.parameters(), lr=..., nvme_path=args.swap_dir)          # after

Every 10 steps it prints the loss, tokens/s and how many bytes of optimizer state are on NVMe
(and how much page-locked host memory the staging buffers hold). --check-torch also trains an
identical copy with torch.optim.AdamW and prints the largest parameter difference at the end.
"""

import argparse
import copy
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from tiermem.torch import NVMeAdamW

DEFAULT_CORPUS = "/usr/share/games/fortunes"


def load_corpus(path: str) -> torch.Tensor:
    """Byte-level tokens of a text file, or of every text file under a directory (sorted path
    order; strfile indexes *.dat/*.u8, hidden names and binary files skipped), as tiermem-train."""
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(root, n) for n in names
                      if not n.startswith(".") and not n.endswith((".dat", ".u8"))]
        files.sort(key=lambda f: os.path.relpath(f, path).encode())
    else:
        files = [path]
    data = bytearray()
    for f in files:
        if not os.path.isfile(f):
            continue
        with open(f, "rb") as fh:
            text = fh.read()
        if text and b"\0" not in text[:8192]:
            data += text
    if not data:
        sys.exit(f"{path}: no text found (install Debian's fortunes package, or pass --data FILE)")
    return torch.frombuffer(data, dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_CORPUS)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sub-group-size", type=int, default=1 << 18, help="elements per NVMe sub-group")
    ap.add_argument("--swap-dir", default=None, help="NVMe directory for the optimizer state [default: a temp dir]")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check-torch", action="store_true", help="also train with torch.optim.AdamW and compare")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tokens = load_corpus(args.data)
    model = GPT(256, args.seq_len, args.d_model, args.layers, args.heads)
    ref = copy.deepcopy(model) if args.check_torch else None
    n_params = sum(p.numel() for p in model.parameters())
    swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="tiermem-swap-")
    opt = NVMeAdamW(model.parameters(), lr=args.lr, weight_decay=0.1, nvme_path=swap_dir,
                    sub_group_size=args.sub_group_size)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.1) if ref else None
    print(f"corpus {args.data}: {len(tokens):,} tokens; model {n_params:,} parameters; "
          f"optimizer state on NVMe {opt.nvme_bytes / 2**20:.1f} MiB in {len(opt._sub_groups)} sub-groups "
          f"under {swap_dir}; staging {opt.staging_bytes / 2**20:.1f} MiB pinned")

    gen = torch.Generator().manual_seed(args.seed)
    t0, done = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([tokens[s: s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1: s + 1 + args.seq_len] for s in starts.tolist()])
        for m, o in ((model, opt), (ref, ref_opt)) if ref else ((model, opt),):
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x).view(-1, 256), y.view(-1))
            loss.backward()
            o.step()
            if m is model:
                main_loss = loss.item()
        done += x.numel()
        if step % 10 == 0 or step == args.steps:
            dt = time.perf_counter() - t0
            stats = opt.swap_stats()
            print(f"step {step:5d}  loss {main_loss:.4f}  {done / dt:,.0f} tokens/s  "
                  f"nvme: {stats['used_bytes'] / 2**20:.1f} MiB state, "
                  f"{stats['bytes_written'] / 2**20:.0f} MiB written, {stats['bytes_read'] / 2**20:.0f} MiB read "
                  f"({stats['engine']}, o_direct={stats['o_direct']})")
    if not math.isfinite(main_loss):
        sys.exit("loss is not finite")
    if ref:
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        print(f"max |param difference| vs torch.optim.AdamW after {args.steps} steps: {diff:.3e}")
    opt.close()


if __name__ == "__main__":
    main()
