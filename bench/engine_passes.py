#!/usr/bin/env python3
"""Forward-only passes through the engine alone (no torch): NVMe bytes read a pass under each
tiermem.prefetch_eviction, against Belady's MIN estimate.

    ~/.cache/tiermem/venv/bin/python bench/engine_passes.py                            # Llama-7B's weights at hidden 1024
    ~/.cache/tiermem/venv/bin/python bench/engine_passes.py --hidden 4096 --vocab 32000  # the 7 B demo's 13.48 GB

A tiermem._tiermem.ZeroEngine (the C++ engine through its binding) over Llama-2-7B's weight list
(embed_tokens; per layer q, k, v, o, gate, up, down and two norms; norm; lm_head) at --hidden, with
intermediate 11008 / 4096 of it (torch_bench_common.llama_7b_scaled), --layers layers and --vocab
rows, bf16, every weight frozen and homed on NVMe in a fresh directory under --dir (removed after),
host and device budgets the fractions --host-fraction and --device-fraction of the base (default:
the 7 B demo's 2 GiB and 1 GiB of 13.48 GB). Each pass gathers every weight in order, sleeps its
bytes / --compute-gbps as its compute, releases it, and ends with end_forward_pass; the first pass
records the trace. Per pass: MB read, seconds, misses (acquires that waited for a read). MIN's
estimate: the base less both budgets (each pass must read what the caches cannot hold); aggressive
prefetching may add its window, a quarter of each budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_bench_common import llama_7b_scaled  # noqa: E402  (importing it imports no torch)


def weights(hidden, layers, vocab):
    inter = llama_7b_scaled(hidden)["intermediate_size"]
    out = [("embed_tokens", vocab * hidden)]
    for i in range(layers):
        out += [(f"layers.{i}.{n}", hidden * hidden) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(f"layers.{i}.{n}", hidden * inter) for n in ("gate_proj", "up_proj", "down_proj")]
        out += [(f"layers.{i}.input_layernorm", hidden), (f"layers.{i}.post_attention_layernorm", hidden)]
    return out + [("norm", hidden), ("lm_head", vocab * hidden)]


def run(a, mode):
    import numpy as np

    from tiermem import _tiermem as tm
    mods = weights(a.hidden, a.layers, a.vocab)
    base = 2 * sum(n for _, n in mods)
    device = int(base * a.device_fraction) // 4096 * 4096
    host = int(base * a.host_fraction) // 4096 * 4096
    swap = tempfile.mkdtemp(prefix="engine_passes_", dir=a.dir)
    try:
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": int(0.9 * a.hidden ** 2),
                                     "reduce_bucket_size": a.hidden ** 2, "stage3_param_persistence_threshold": 10 * a.hidden,
                                     "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": False},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": False}},
               "tiermem": {"host_budget_bytes": host, "device_budget_bytes": device, "prefetch_eviction": mode}}
        engine = tm.ZeroEngine(tm.parse_config(json.dumps(cfg)), [n for _, n in mods], frozen=[True] * len(mods))
        try:
            for i, (name, n) in enumerate(mods):
                engine.register_module(name, np.full(n, 0.01 * (i % 7), dtype=np.float32), n)
            passes = []
            for _ in range(a.passes):
                s0, t0 = engine.stats(), time.perf_counter()
                for i, (_, n) in enumerate(mods):
                    x = engine.gather(i, "forward")
                    time.sleep(2 * n / (a.compute_gbps * 1e9))
                    del x
                engine.end_forward_pass()
                s1 = engine.stats()
                passes.append({"read_mb": (s1["nvme_read_bytes"] - s0["nvme_read_bytes"]) / 1e6,
                               "seconds": time.perf_counter() - t0, "misses": s1["store_misses"] - s0["store_misses"]})
        finally:
            engine.close()
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return {"mode": mode, "weights": len(mods), "base_mb": base / 1e6, "device_mb": device / 1e6, "host_mb": host / 1e6,
            "min_estimate_mb": (base - device - host) / 1e6, "window_mb": (device + host) / 4e6, "passes": passes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--vocab", type=int, default=None, help="embedding and head rows (default 7.8 x hidden)")
    p.add_argument("--device-fraction", type=float, default=1 * 2 ** 30 / 13.4784e9)
    p.add_argument("--host-fraction", type=float, default=2 * 2 ** 30 / 13.4784e9)
    p.add_argument("--compute-gbps", type=float, default=3.0, help="a weight's compute: its bytes at this rate (GB/s)")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--modes", default="min,auto", help="tiermem.prefetch_eviction values, comma-separated")
    p.add_argument("--dir", default="/tmp", help="where the NVMe directory is made (default /tmp)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.vocab is None:
        a.vocab = a.hidden * 78 // 10
    if a.passes < 2 or a.compute_gbps <= 0:
        p.error("--passes must be at least 2 and --compute-gbps above 0")
    results = [run(a, m) for m in a.modes.split(",")]
    for r in results:
        steady = r["passes"][1:]
        reads = ", ".join(f"{x['read_mb']:.0f}" for x in steady)
        secs = ", ".join(f"{x['seconds']:.2f}" for x in steady)
        print(f"{r['mode']:>10}: MB read a pass (after the first) {reads}; seconds {secs}; "
              f"MIN's estimate {r['min_estimate_mb']:.0f} (+ window {r['window_mb']:.0f}); base {r['base_mb']:.0f} MB, "
              f"{r['weights']} weights, budgets device {r['device_mb']:.0f} / host {r['host_mb']:.0f} MB")
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
