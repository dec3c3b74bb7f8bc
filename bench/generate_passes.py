#!/usr/bin/env python3
"""generate() through a forward-only tiermem.torch engine: what a prefetch may evict
(tiermem.prefetch_eviction "min" against "auto"), interleaved, beside the plain resident model.

    ~/.cache/tiermem/venv/bin/python bench/generate_passes.py                        # 6 layers, 2 rounds
    ~/.cache/tiermem/venv/bin/python bench/generate_passes.py --layers 8 --budgets 2GiB,512MiB --rounds 3 --json

Model: transformers.LlamaForCausalLM with Llama-2-7B's layer shape (hidden 4096, intermediate 11008,
32 heads, vocab 32000, untied head) and --layers layers (6: 1.48 B parameters, 2.95 GB in bf16);
--hidden and --vocab scale it (heads of 128, intermediate 11008 / 4096 of the hidden size). bf16,
initialised under torch.manual_seed(0) (the same weights in every contender). The tiermem contenders
build it under tiermem.torch.zero.Init with parameters on NVMe in a fresh directory under --dir,
every parameter frozen and no optimizer section (a forward-only engine), host and device budgets
--budgets, and tiermem.prefetch_eviction set to the contender's value. Each contender runs in its
own process: generate() of --new-tokens greedy tokens after a 16-token seeded random prompt at batch
--batch, twice; the first records the engine's trace and warms the caches, the second is timed
(seconds, tokens/s, the NVMe bytes it read, the time the engine's acquires waited). Rounds
interleave the contenders; the table gives medians, the ratio against "min" in the same round, and
whether every contender's tokens equal the plain model's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_bench_common as common  # noqa: E402


def worker(a):
    import torch
    torch.set_num_threads(a.threads)
    transformers = common.import_transformers("LlamaForCausalLM")
    config = common.llama_config(common.llama_7b_scaled(a.hidden, a.layers, a.vocab), 64)
    engine = None
    torch.manual_seed(0)
    if a.worker == "plain":
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    else:
        import tiermem.torch as tt
        swap = os.path.join(a.work, a.worker)
        os.makedirs(swap, exist_ok=True)
        host, device = a.budgets.split(",")
        cfg = common.ds_config(hidden=a.hidden, batch=a.batch, nvme_dir=swap, sub_group_size=int(1e8),
                               buffer_size=a.vocab * a.hidden,
                               tiermem={"host_budget_bytes": host, "device_budget_bytes": device,
                                        "prefetch_eviction": a.worker})
        cfg["bf16"] = {"enabled": True}
        del cfg["optimizer"]
        with tt.zero.Init(config=cfg):
            model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
        model.requires_grad_(False)
        engine, *_ = tt.initialize(model=model, config=cfg)
        model = engine.module
    model.requires_grad_(False)
    model.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.batch, 16), generator=g)
    out = {"contender": a.worker}
    for run in ("warm", "timed"):
        before = engine.stats() if engine is not None else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=a.new_tokens,
                               min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
        r = {"seconds": dt, "tokens_per_s": a.batch * a.new_tokens / dt, "tokens": y[:, 16:].tolist()}
        if engine is not None:
            st = engine.stats()
            r["nvme_read_bytes"] = st["nvme_read_bytes"] - before["nvme_read_bytes"]
            r["stall_s"] = (st["stall_ns"] - before["stall_ns"]) / 1e9
        out[run] = r
    out["max_rss_bytes"] = common.max_rss_bytes()
    if engine is not None:
        engine.close()
    print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--layers", type=int, default=6, help="decoder layers of Llama-2-7B's shape (default 6)")
    p.add_argument("--hidden", type=int, default=4096,
                   help="hidden size, a multiple of 128 (default 4096, Llama-2-7B's); the MLP scales with it")
    p.add_argument("--vocab", type=int, default=32000, help="embedding and head rows (default 32000)")
    p.add_argument("--budgets", default="1GiB,512MiB", help="tiermem host,device budgets (default 1GiB,512MiB)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated (default 8)")
    p.add_argument("--batch", type=int, default=1, help="prompts (default 1)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--contenders", default="plain,min,auto",
                   help="plain and tiermem.prefetch_eviction values (default plain,min,auto)")
    p.add_argument("--dir", default="/tmp", help="where the swap directories are made (default /tmp)")
    common.add_worker_flags(p)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.layers < 1 or a.new_tokens < 1 or a.batch < 1 or a.rounds < 1 or a.vocab < 1:
        raise SystemExit("generate_passes: --layers, --new-tokens, --batch, --rounds and --vocab must be at least 1")
    if a.hidden < 128 or a.hidden % 128:
        raise SystemExit(f"generate_passes: --hidden {a.hidden} is not a positive multiple of 128 (heads of 128)")
    contenders = [c for c in a.contenders.split(",") if c]
    bad = [c for c in contenders if c not in ("plain", "min", "auto", "aggressive")]
    if bad:
        raise SystemExit(f"generate_passes: unknown contender {bad[0]!r}: plain, min, auto or aggressive")
    work = os.path.join(os.path.abspath(a.dir), "generate_passes")
    env = common.worker_env(a.threads, single_rank=True)
    runs = {c: [] for c in contenders}
    try:
        for rnd in range(a.rounds):
            for c in contenders:
                shutil.rmtree(work, ignore_errors=True)
                os.makedirs(work)
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", c, "--work", work, "--layers",
                       str(a.layers), "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--budgets", a.budgets,
                       "--new-tokens", str(a.new_tokens), "--batch", str(a.batch), "--threads", str(a.threads)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode != 0 or not lines:
                    raise SystemExit(f"generate_passes: contender {c} (round {rnd + 1}) failed, exit status "
                                     f"{proc.returncode}:\n{proc.stderr[-3000:]}")
                r = json.loads(lines[-1])
                runs[c].append(r)
                t = r["timed"]
                extra = (f", NVMe read {t['nvme_read_bytes'] / 1e9:.2f} GB, waits {t['stall_s']:.2f} s"
                         if "nvme_read_bytes" in t else "")
                print(f"round {rnd + 1} {c}: {t['seconds']:.2f} s, {t['tokens_per_s']:.3f} tokens/s{extra}",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for c, rs in runs.items():
        t = [r["timed"] for r in rs]
        s = {"seconds": statistics.median(x["seconds"] for x in t),
             "tokens_per_s": statistics.median(x["tokens_per_s"] for x in t),
             "max_rss_bytes": max(r["max_rss_bytes"] for r in rs)}
        if "nvme_read_bytes" in t[0]:
            s["nvme_read_bytes"] = statistics.median(x["nvme_read_bytes"] for x in t)
            s["stall_s"] = statistics.median(x["stall_s"] for x in t)
        if "min" in runs and c != "min":
            s["speed_vs_min"] = statistics.median(runs["min"][i]["timed"]["seconds"] / x["seconds"]
                                                  for i, x in enumerate(t))
        summary[c] = s
    ref = runs.get("plain", next(iter(runs.values())))[0]["timed"]["tokens"]
    same = all(r[k]["tokens"] == ref for rs in runs.values() for r in rs for k in ("warm", "timed"))
    cpu, avx512 = common.cpu_name()
    if a.json:
        print(json.dumps({"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "budgets": a.budgets,
                          "new_tokens": a.new_tokens, "batch": a.batch, "rounds": a.rounds, "cpu": cpu,
                          "avx512": avx512, "summary": summary, "tokens_equal": same, "runs": runs}))
        return 0
    print(f"Llama-2-7B layer shape at hidden {a.hidden}, vocab {a.vocab}, {a.layers} layers, bf16; budgets "
          f"{a.budgets}; {a.new_tokens} tokens at batch {a.batch}; medians of {a.rounds} interleaved rounds; {cpu}, "
          f"{'AVX-512' if avx512 else 'no AVX-512'}")
    print("| contender | seconds | tokens/s | NVMe read (GB) | waits (s) | x min | max RSS (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for c, s in summary.items():
        gb = f"{s['nvme_read_bytes'] / 1e9:.2f}" if "nvme_read_bytes" in s else ""
        wait = f"{s['stall_s']:.2f}" if "stall_s" in s else ""
        ratio = f"{s['speed_vs_min']:.2f}" if "speed_vs_min" in s else ""
        print(f"| {c} | {s['seconds']:.2f} | {s['tokens_per_s']:.3f} | {gb} | {wait} | {ratio} | "
              f"{s['max_rss_bytes'] / 2**30:.2f} |")
    print(f"tokens equal in every run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
