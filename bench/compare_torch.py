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

ds_config (both offloading contenders): stage 3, offload_param {nvme, buffer_count 5,
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
CONTENDERS = ("deepspeed", "tiermem", "torch", "tiermem_none", "tiermem_init")
SHAPES = {"small": dict(n_layer=12, n_embd=768, n_head=12), "medium": dict(n_layer=24, n_embd=1024, n_head=16)}


# ---------------------------------------------------------------- workers (run in their own process)

def build_model(a):
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**SHAPES[a.model])
    return transformers.GPT2LMHeadModel(cfg)


def ds_config(a, nvme_dir, offload=True):
    hidden = SHAPES[a.model]["n_embd"]
    zero = {"stage": 3, "sub_group_size": int(a.sub_group_size),
            "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
    if offload:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": int(a.ds_buffer_size), "max_in_cpu": int(1e9)}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                                     "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "intra_op_parallelism": 1},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_worker(a):
    import resource

    import torch
    torch.manual_seed(1)
    data = torch.randint(0, 50257, (a.batch, a.seq))
    nvme_dir = tempfile.mkdtemp(prefix=f"compare_torch_{a.worker}_", dir=a.dir)
    info = {}
    marks = {}
    try:
        import transformers
        # The model's classes imported before any zero.Init, as a script's imports at its top do
        # (DeepSpeed 0.19.8's Init fails on importing transformers' GPT-2 file inside it, on torch 2.15).
        transformers.GPT2LMHeadModel, transformers.GPT2Config
        t_init = time.perf_counter()
        marks["imported"] = rss_marks()
        if a.worker == "deepspeed":
            import deepspeed
            init_deepspeed_dist()
            if a.build == "init":
                # As DeepSpeed's HF users build it: HfDeepSpeedConfig (kept alive) makes from_config
                # build under deepspeed.zero.Init (each parameter partitioned to nvme, the config's
                # offload_param, as its module is built) and initialise the weights gathered.
                from transformers.integrations import HfDeepSpeedConfig
                info_keep = HfDeepSpeedConfig(ds_config(a, nvme_dir))  # noqa: F841
                torch.manual_seed(0)
                model = transformers.GPT2LMHeadModel._from_config(transformers.GPT2Config(**SHAPES[a.model]))
            else:
                model = build_model(a)
        elif a.worker in ("tiermem", "tiermem_init") and a.build == "init":
            # The model built under zero.Init: its parameters go to the NVMe staging module by
            # module, never all in host memory.
            import tiermem.torch as tt
            cfg = ds_config(a, nvme_dir)
            if a.worker == "tiermem_init":
                cfg["tiermem"] = {"host_budget_bytes": a.init_host_budget, "device_budget_bytes": a.init_device_budget}
            with tt.zero.Init(config=cfg):
                model = build_model(a)
        else:
            model = build_model(a)
        marks["built"] = rss_marks()
        if a.worker == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(a, nvme_dir))
            info["deepspeed"] = deepspeed.__version__

            def step():
                loss = engine(input_ids=data, labels=data).loss
                engine.backward(loss)
                engine.step()
                return loss
        elif a.worker in ("tiermem", "tiermem_none", "tiermem_init"):
            import tiermem.torch as tt
            cfg = ds_config(a, nvme_dir, offload=a.worker != "tiermem_none")
            if a.worker == "tiermem_init":
                cfg["tiermem"] = {"host_budget_bytes": a.init_host_budget, "device_budget_bytes": a.init_device_budget}
            if a.worker == "tiermem_none" and a.none_host_budget:
                # tiermem's default host budget (1/16 of RAM, at most 1 GiB) refuses a resident 124 M
                # model (1.9 GiB of host homes) at offload none: the budget is raised, nothing else.
                cfg["tiermem"] = {"host_budget_bytes": a.none_host_budget}
            engine, *_ = tt.initialize(model=model, config=cfg)

            def step():
                loss = engine(input_ids=data, labels=data).loss
                engine.backward(loss)
                engine.step()
                return loss
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
        marks["initialized"] = rss_marks()

        times, losses = [], []
        prof = None
        for i in range(a.steps):
            if a.profile and i == 2:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.item()))
            if i == 0:
                marks["step1"] = rss_marks()
        if prof is not None:
            prof.disable()
            report_profile(prof, step, a)
        measured = times[2:] if len(times) > 2 else times
        out = {"step_s": statistics.median(measured), "step_times": times, "losses": losses,
               "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "threads": torch.get_num_threads(), "rss_marks": marks, **info}
        if a.worker.startswith("tiermem"):
            st = engine.stats()
            out["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float, str))}
            engine.close()
        print(json.dumps(out))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def init_deepspeed_dist():
    import logging
    import socket

    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def rss_marks():
    """(VmRSS, VmHWM) of this process now, in bytes: where the max RSS was reached."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("VmRSS:", "VmHWM:")):
                out[ln.split(":")[0]] = int(ln.split()[1]) * 1024
    return [out.get("VmRSS", 0), out.get("VmHWM", 0)]


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

def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "unknown", False
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return name, " avx512f" in flags


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def spawn(a, who, profile=False):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OMP_WAIT_POLICY="PASSIVE", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false")
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

    cpu, avx512 = cpu_name()
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
            la = loadavg()
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
