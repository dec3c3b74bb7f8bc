#!/usr/bin/env python3
"""Training a Hugging Face GPT-2 on the CPU: tiermem.torch against DeepSpeed ZeRO-3 and plain PyTorch.

    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py                 # 2 rounds, GPT-2 124 M
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --rounds 3 --json --dir /mnt/nvme
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --model medium --contenders deepspeed,tiermem
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --profile tiermem   # where its time goes

Model: transformers.GPT2LMHeadModel from GPT2Config (--model small: the defaults, n_layer 12,
n_embd 768, vocab 50257, 124 M parameters; --model medium: n_layer 24, n_embd 1024, 355 M), built
under a fixed seed (no download); one fixed random token batch of --batch x --seq (default 1 x
128) as input_ids and labels; fp32; AdamW lr 1e-4, weight decay 0.01, clipping 1.0.

Contenders, each in its own fresh process (so one cannot warm the next, and ru_maxrss is its own):
  deepspeed     deepspeed.initialize (0.19.x, DS_ACCELERATOR=cpu, gloo, one rank), ZeRO stage 3,
                offload_param and offload_optimizer on nvme in a fresh directory under --dir; the
                model built as DeepSpeed's HF users build it (--build init, the default):
                HfDeepSpeedConfig, then from_config, which builds under deepspeed.zero.Init and
                initialises the weights gathered
  tiermem       tiermem.torch.initialize with the same ds_config (tiermem's default budgets); the
                model built under tiermem.torch.zero.Init (--build init)
  torch         the plain resident loop: model(...).loss.backward(), clip_grad_norm_,
                torch.optim.AdamW (torch's default implementation for CPU tensors)
  tiermem_none  tiermem.torch at stage 3 with offload none: the hooks' cost against the plain
                loop. Default budgets except tiermem.host_budget_bytes (--none-host-budget,
                default 6 GiB): the default (1/16 of RAM, at most 1 GiB) refuses GPT-2 124 M there
  tiermem_init  tiermem as a user short of memory runs it: built under zero.Init, host and device
                budgets --init-host-budget and --init-device-budget (256 MiB each), otherwise the
                same ds_config
--build plain builds every model outside any Init. The model's classes are imported before any
Init (DeepSpeed 0.19.8's Init fails when transformers imports GPT-2's file inside it, on torch
2.15).
Every contender runs with OMP_NUM_THREADS=--threads (default 2) and OMP_WAIT_POLICY=PASSIVE.

Per run: step time = the median wall time of steps 3..--steps (default 10) of forward + backward +
optimizer step; max RSS = getrusage(RUSAGE_SELF).ru_maxrss at the end; rss_marks (--json, the
first round's) = [VmRSS, VmHWM] after the imports, the build, initialize and step 1: where the
peak is reached. Rounds (--rounds, default
2) are interleaved and rotated (round r starts with the r-th contender); the table shows the median
over rounds. The 1-minute load average is recorded before every run; the CPU model and whether it
has AVX-512 are printed. Ratios: speed = step time of the other / step time of tiermem (> 1:
tiermem is faster); RSS = tiermem's / the other's.

ds_config (both offloading contenders; torch_bench_common.ds_config): stage 3, offload_param {nvme, buffer_count 5,
buffer_size --ds-buffer-size (default 4e7 elements: the smallest round figure over GPT-2's largest
tensor, wte, 38.6 M; DeepSpeed's own default is 1e8), max_in_cpu 1e9}, offload_optimizer {nvme,
buffer_count 4}, sub_group_size --sub-group-size (default 1e8; DeepSpeed's default is 1e9),
pin_memory false (the CPU accelerator has no pinned memory), aio block 1 MiB, queue depth 8,
reduce_bucket_size / stage3_prefetch_bucket_size / stage3_param_persistence_threshold as HF's
"auto" derives them (H*H, 0.9*H*H, 10*H).

--json prints one object as the last line: {"results": {contender: {step_s, max_rss_bytes, ...}},
"ratios": {...}, "loadavg": [...], "cpu": ..., "avx512": bool, ...}.

--profile CONTENDER runs that contender once more under cProfile over steps 3..--steps and prints
its top functions by cumulative and by own time (the hooks, the engine's gather / reduce / step,
torch's compute) plus torch.profiler's top operators.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_bench_common as common  # noqa: E402

CONTENDERS = ("deepspeed", "tiermem", "torch", "tiermem_none", "tiermem_init")
SHAPES = common.GPT2_SHAPES


# ---------------------------------------------------------------- workers (run in their own process)

def ds_config(a, nvme_dir, offload=True):
    """This run's ds_config (common.ds_config for GPT-2 of --model, --batch, --sub-group-size,
    --ds-buffer-size); the tiermem section per contender."""
    tiermem = None
    if a.worker == "tiermem_init":
        tiermem = {"host_budget_bytes": a.init_host_budget, "device_budget_bytes": a.init_device_budget}
    elif a.worker == "tiermem_none" and a.none_host_budget:
        # tiermem's default host budget (1/16 of RAM, at most 1 GiB) refuses a resident 124 M
        # model (1.9 GiB of host homes) at offload none: the budget is raised, nothing else.
        tiermem = {"host_budget_bytes": a.none_host_budget}
    return common.ds_config(hidden=SHAPES[a.model]["n_embd"], batch=a.batch, nvme_dir=nvme_dir,
                            sub_group_size=a.sub_group_size, buffer_size=a.ds_buffer_size, offload=offload,
                            tiermem=tiermem)


def run_worker(a):
    import torch
    torch.manual_seed(1)
    data = torch.randint(0, common.GPT2_VOCAB, (a.batch, a.seq))
    nvme_dir = tempfile.mkdtemp(prefix=f"compare_torch_{a.worker}_", dir=a.dir)
    info = {}
    marks = {}
    try:
        transformers = common.import_transformers("GPT2LMHeadModel", "GPT2Config")
        t_init = time.perf_counter()
        marks["imported"] = common.rss_marks()
        if a.worker == "deepspeed":
            import deepspeed
            common.init_deepspeed_gloo()
            if a.build == "init":
                model, info_keep = common.build_under_deepspeed(  # noqa: F841  (kept alive)
                    transformers.GPT2LMHeadModel, transformers.GPT2Config(**SHAPES[a.model]), ds_config(a, nvme_dir))
            else:
                model = common.build_gpt2(a.model)
        elif a.worker in ("tiermem", "tiermem_init") and a.build == "init":
            # The model built under zero.Init: its parameters go to the NVMe staging module by
            # module, never all in host memory.
            import tiermem.torch as tt
            with tt.zero.Init(config=ds_config(a, nvme_dir)):
                model = common.build_gpt2(a.model)
        else:
            model = common.build_gpt2(a.model)
        marks["built"] = common.rss_marks()
        if a.worker == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(a, nvme_dir))
            info["deepspeed"] = deepspeed.__version__

            def step():
                return common.engine_step(engine, data)
        elif a.worker in ("tiermem", "tiermem_none", "tiermem_init"):
            import tiermem.torch as tt
            engine, *_ = tt.initialize(model=model, config=ds_config(a, nvme_dir, offload=a.worker != "tiermem_none"))

            def step():
                return common.engine_step(engine, data)
        elif a.worker == "torch":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

            def step():
                loss = model(input_ids=data, labels=data).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                return loss
        else:
            raise SystemExit(f"unknown contender {a.worker}")
        info["init_s"] = time.perf_counter() - t_init
        marks["initialized"] = common.rss_marks()

        prof = []

        def before(i):
            if a.profile and i == 2:
                import cProfile
                prof.append(cProfile.Profile())
                prof[0].enable()

        def after(i, seconds, loss):
            if i == 0:
                marks["step1"] = common.rss_marks()

        times, losses = common.timed_steps(step, a.steps, before, after)
        if prof:
            prof[0].disable()
            report_profile(prof[0], step, a)
        measured = times[2:] if len(times) > 2 else times
        out = {"step_s": statistics.median(measured), "step_times": times, "losses": losses,
               "max_rss_bytes": common.max_rss_bytes(), "threads": torch.get_num_threads(), "rss_marks": marks,
               **info}
        if a.worker.startswith("tiermem"):
            out["stats"] = common.scalar_stats(engine)
            engine.close()
        print(json.dumps(out))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def report_profile(prof, step, a):
    import io
    import pstats

    import torch
    n = a.steps - 2
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
        print(f"==== cProfile over {n} steps, by {key} ====", file=sys.stderr)
        print(s.getvalue(), file=sys.stderr)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        step()
    print("==== torch.profiler, one more step ====", file=sys.stderr)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


# ---------------------------------------------------------------- driver

def spawn(a, who, profile=False):
    env = common.worker_env(a.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", who, "--model", a.model, "--seq", str(a.seq),
           "--batch", str(a.batch), "--steps", str(a.steps), "--dir", a.dir, "--ds-buffer-size",
           str(a.ds_buffer_size), "--sub-group-size", str(a.sub_group_size), "--none-host-budget", a.none_host_budget,
           "--init-host-budget", a.init_host_budget, "--init-device-budget", a.init_device_budget, "--build", a.build]
    if profile:
        cmd.append("--profile")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    wall = time.perf_counter() - t0
    if profile:
        sys.stderr.write(r.stderr)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {r.returncode}: " + " | ".join(tail)}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default="/tmp", help="where each run's nvme directory is made (default /tmp)")
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--ds-buffer-size", type=float, default=4e7)
    p.add_argument("--sub-group-size", type=float, default=1e8)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--none-host-budget", default="6GiB",
                   help="tiermem.host_budget_bytes for tiermem_none ('' for tiermem's default, which refuses 124 M)")
    p.add_argument("--init-host-budget", default="256MiB", help="tiermem.host_budget_bytes of tiermem_init")
    p.add_argument("--init-device-budget", default="256MiB", help="tiermem.device_budget_bytes of tiermem_init")
    p.add_argument("--build", choices=("init", "plain"), default="init",
                   help="init (default): DeepSpeed's and tiermem's contenders build the model under their zero.Init, "
                        "as a user short of memory does (HF: HfDeepSpeedConfig); plain: outside it")
    p.add_argument("--profile", nargs="?", const="tiermem", default=None,
                   help="run CONTENDER (default tiermem) once under cProfile and torch.profiler")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.ds_buffer_size = int(float(a.ds_buffer_size))
    a.sub_group_size = int(float(a.sub_group_size))
    if a.worker:
        return run_worker(a)

    cpu, avx512 = common.cpu_name()
    print(f"CPU: {cpu} ({'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} logical CPUs; "
          f"OMP_NUM_THREADS={a.threads} OMP_WAIT_POLICY=PASSIVE for every contender; "
          f"GPT-2 {a.model}, batch {a.batch} x seq {a.seq}, fp32; nvme dir under {a.dir}", flush=True)
    if a.profile:
        r = spawn(a, a.profile, profile=True)
        print(json.dumps(r) if "error" in r else f"{a.profile}: step {r['step_s']:.3f} s (median of steps 3..)")
        return
    who = [c.strip() for c in a.contenders.split(",") if c.strip()]
    runs = {c: [] for c in who}
    loads = []
    for rnd in range(a.rounds):
        order = who[rnd % len(who):] + who[:rnd % len(who)]
        for c in order:
            la = common.loadavg()
            loads.append(la)
            r = spawn(a, c)
            r["loadavg_before"] = la
            runs[c].append(r)
            if "error" in r:
                print(f"round {rnd + 1} {c:13s} FAILED {r['error'][:400]}", flush=True)
            else:
                print(f"round {rnd + 1} {c:13s} step {r['step_s']:7.3f} s  max RSS {r['max_rss_bytes'] / 2**30:6.2f} GiB"
                      f"  init {r['init_s']:5.1f} s  load {la:.2f}  losses {r['losses'][0]:.4f}..{r['losses'][-1]:.4f}",
                      flush=True)
    results = {}
    for c, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            results[c] = {"error": rs[0]["error"] if rs else "not run"}
            continue
        results[c] = {"step_s": statistics.median(r["step_s"] for r in ok),
                      "max_rss_bytes": statistics.median(r["max_rss_bytes"] for r in ok),
                      "init_s": statistics.median(r["init_s"] for r in ok),
                      "rounds": len(ok), "step_s_each": [r["step_s"] for r in ok],
                      "first_loss": ok[0]["losses"][0], "last_loss": ok[0]["losses"][-1]}
        if "stats" in ok[0]:
            results[c]["stats"] = ok[0]["stats"]
        results[c]["rss_marks"] = ok[0].get("rss_marks")

    def ratio(num, den, key, invert=False):
        x, y = results.get(num, {}), results.get(den, {})
        if key not in x or key not in y:
            return None
        return y[key] / x[key] if invert else x[key] / y[key]

    ratios = {"tiermem_vs_deepspeed_speed": ratio("tiermem", "deepspeed", "step_s", invert=True),
              "tiermem_vs_deepspeed_rss": ratio("tiermem", "deepspeed", "max_rss_bytes"),
              "tiermem_vs_torch_speed": ratio("tiermem", "torch", "step_s", invert=True),
              "tiermem_none_vs_torch_speed": ratio("tiermem_none", "torch", "step_s", invert=True),
              "tiermem_init_vs_deepspeed_speed": ratio("tiermem_init", "deepspeed", "step_s", invert=True),
              "tiermem_init_vs_deepspeed_rss": ratio("tiermem_init", "deepspeed", "max_rss_bytes")}
    print()
    print("| contender | step (s, median) | max RSS (GiB) | init (s) |")
    print("|---|---|---|---|")
    for c, r in results.items():
        if "error" in r:
            print(f"| {c} | failed: {r['error'][:120]} | | |")
        else:
            print(f"| {c} | {r['step_s']:.3f} | {r['max_rss_bytes'] / 2**30:.2f} | {r['init_s']:.1f} |")
    for k, v in ratios.items():
        print(f"{k}: {'n/a' if v is None else f'{v:.2f}'}")
    print(f"load average (1 min) before runs: min {min(loads):.2f} median {statistics.median(loads):.2f} "
          f"max {max(loads):.2f}")
    if a.json:
        print(json.dumps({"results": results, "ratios": ratios, "loadavg": loads, "cpu": cpu, "avx512": avx512,
                          "threads": a.threads, "model": a.model, "seq": a.seq, "batch": a.batch,
                          "steps": a.steps, "rounds": a.rounds}))


if __name__ == "__main__":
    main()
