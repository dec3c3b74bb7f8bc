#!/usr/bin/env python3
"""Training a Hugging Face GPT-2 on the CPU with several ranks: tiermem.torch at 1, 2, 3 ranks against DeepSpeed ZeRO-3.

    ~/.cache/tiermem/venv/bin/python bench/compare_torch_ranks.py                  # 2 rounds, GPT-2 124 M
    ~/.cache/tiermem/venv/bin/python bench/compare_torch_ranks.py --ranks 1,2 --ds-ranks 2 --json
    ~/.cache/tiermem/venv/bin/python bench/compare_torch_ranks.py --model medium --dir /mnt/nvme --rounds 3
    ~/.cache/tiermem/venv/bin/python bench/compare_torch_ranks.py --ds-ranks 0     # tiermem only

Model: transformers.GPT2LMHeadModel from GPT2Config (--model small: the defaults, 124 M parameters;
--model medium: 355 M), built under torch.manual_seed(0) on every rank (no download); fp32; AdamW
lr 1e-4, weight decay 0.01, clipping 1.0 (compare_torch.py's model and ds_config, both from
torch_bench_common.py).
Data: each rank draws one fixed random token batch of --batch x --seq (default 1 x 128) under
torch.manual_seed(1 + rank), used as input_ids and labels at every step. Weak scaling: the micro
batch is per rank, so each rank does the same work at every world size and the global batch grows
with the ranks; a perfect runtime keeps the step time flat as ranks are added.

Contenders, each run a fresh `torchrun --nproc_per_node N --master_addr 127.0.0.1 --master_port
<free port>` (torchrun beside this Python), so one cannot warm the next and each rank's ru_maxrss is
its own. Every rank runs with OMP_NUM_THREADS = max(1, --threads // N) (--threads default 2) and
OMP_WAIT_POLICY=PASSIVE:
  tiermem@N     for N in --ranks (default 1,2,3): the model built under tiermem.torch.zero.Init,
                then tiermem.torch.initialize(model=model, config=ds_config); tiermem makes the
                process group itself (gloo, from torchrun's environment) when N > 1
  deepspeed@N   N = --ds-ranks (default 2; 0: none): deepspeed.initialize (0.19.x,
                DS_ACCELERATOR=cpu, deepspeed.init_distributed(dist_backend="gloo") under
                torchrun's RANK / WORLD_SIZE); the model built as DeepSpeed's HF users build it:
                HfDeepSpeedConfig, then _from_config, which builds under deepspeed.zero.Init
ds_config (both): torch_bench_common.ds_config: stage 3, offload_param and offload_optimizer on nvme
(see compare_torch.py for the buffers and bucket sizes). Each run gets a fresh nvme directory
under --dir, shared by its ranks: tiermem makes rank<r>/ under it, DeepSpeed names its files per
rank.

Per rank: step time = the median wall time of steps 3..--steps (default 10) of forward + backward
+ optimizer step; max RSS = getrusage(RUSAGE_SELF).ru_maxrss at the end; for tiermem with N > 1
the communication share = the growth of engine.stats()["comm_blocked_s"] (seconds the training
thread was blocked in the engine's collectives) from the start of step 3 to the end of the last
step, over the sum of those steps' times. At one rank there are no collectives and stats() has no
comm keys: the share is 0. Each rank writes its result as JSON to its own file in a temporary
directory (--out, with {rank} in the name); the driver reads them.

Per contender and round: step = the slowest rank's step time, RSS = the largest rank's max RSS,
comm share = the mean over ranks. Rounds (--rounds, default 2) are interleaved and rotated (round
r starts with the r-th contender); the table shows the median over rounds. The 1-minute load
average is recorded before every run; the CPU model and whether it has AVX-512 are printed.
Ratios: speed = deepspeed@D step / tiermem@D step (> 1: tiermem faster), RSS = tiermem@D's per
rank / deepspeed@D's per rank, for D = --ds-ranks; weak scaling = tiermem@1 step / tiermem@N step
(1: flat). A contender that fails (non-zero exit, or past --timeout, default 1800 s a run) is
reported with its error or the tail of its stderr; the others still run.

On a machine with few cores (2 here) the ranks of one run share the CPUs: each gets fewer
threads, and a rank that reaches a collective first waits for the others' compute, so the
communication share measures mostly that contention (and the ranks' skew), not the transport.

--json prints one object as the last line: {"results": {contender: {step_s, max_rss_bytes,
comm_share, ranks, ...}}, "ratios": {...}, "loadavg": [...], "cpu": ..., "avx512": bool, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_bench_common as common  # noqa: E402

SHAPES = common.GPT2_SHAPES


# ---------------------------------------------------------------- workers (one per rank, under torchrun)

def run_worker(a):
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out_path = a.out.format(rank=rank)
    with open(out_path + ".pid", "w") as f:  # torchrun starts each rank in its own session: for the driver's timeout
        f.write(str(os.getpid()))
    try:
        out = worker_body(a, rank, world)
    except BaseException as e:  # the rank's own error, for the driver's report
        tb = traceback.format_exc().strip().splitlines()
        with open(out_path, "w") as f:
            json.dump({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": tb[-12:]}, f)
        raise
    with open(out_path, "w") as f:
        json.dump(out, f)


def worker_body(a, rank, world):
    import torch
    torch.manual_seed(1 + rank)
    data = torch.randint(0, common.GPT2_VOCAB, (a.batch, a.seq))
    marks = {}
    info = {}
    transformers = common.import_transformers("GPT2LMHeadModel", "GPT2Config")
    t_init = time.perf_counter()
    marks["imported"] = common.rss_marks()
    cfg = common.ds_config(hidden=SHAPES[a.model]["n_embd"], batch=a.batch, nvme_dir=a.nvme_dir,
                           sub_group_size=a.sub_group_size, buffer_size=a.ds_buffer_size)
    engine = None
    if a.worker == "deepspeed":
        import deepspeed
        common.init_deepspeed_gloo(single_process=False)  # torchrun's RANK / WORLD_SIZE / MASTER_*
        model, keep = common.build_under_deepspeed(  # noqa: F841  (kept alive)
            transformers.GPT2LMHeadModel, transformers.GPT2Config(**SHAPES[a.model]), cfg)
        marks["built"] = common.rss_marks()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        info["deepspeed"] = deepspeed.__version__
    elif a.worker == "tiermem":
        import tiermem.torch as tt
        with tt.zero.Init(config=cfg):
            model = common.build_gpt2(a.model)  # torch.manual_seed(0) inside
        marks["built"] = common.rss_marks()
        engine, *_ = tt.initialize(model=model, config=cfg)  # makes the gloo group from the env at world > 1
    else:
        raise SystemExit(f"unknown worker {a.worker}")
    info["init_s"] = time.perf_counter() - t_init
    marks["initialized"] = common.rss_marks()

    def comm_blocked():
        if a.worker != "tiermem" or world == 1:
            return None
        return engine.stats()["comm_blocked_s"]

    first = 2 if a.steps > 2 else 0  # the measured steps: 3..--steps
    blocked = {}

    def before(i):
        if i == first:
            blocked[0] = comm_blocked()

    def after(i, seconds, loss):
        if i == 0:
            marks["step1"] = common.rss_marks()

    times, losses = common.timed_steps(lambda: common.engine_step(engine, data), a.steps, before, after)
    blocked0, blocked1 = blocked.get(0), comm_blocked()
    measured = times[first:]
    out = {"rank": rank, "world_size": world, "step_s": statistics.median(measured), "step_times": times,
           "losses": losses, "max_rss_bytes": common.max_rss_bytes(),
           "threads": torch.get_num_threads(), "rss_marks": marks, **info}
    if a.worker == "tiermem":
        st = engine.stats()
        out["stats"] = common.scalar_stats(engine)
        if world == 1:
            out["comm_share"] = 0.0  # no collectives at one rank
        else:
            out["comm_blocked_s"] = blocked1 - blocked0
            out["comm_calls"] = st["comm_calls"]
            out["comm_share"] = (blocked1 - blocked0) / sum(measured)
        engine.close()
    return out


# ---------------------------------------------------------------- driver

def tail(text, n=15):
    return " | ".join(text.strip().splitlines()[-n:])


def spawn(a, who, nproc):
    """One torchrun of `who` at `nproc` ranks; the per-rank results, or {"error": ...}."""
    per_rank_threads = max(1, a.threads // nproc)
    env = common.worker_env(per_rank_threads)
    work = tempfile.mkdtemp(prefix=f"compare_torch_ranks_{who}{nproc}_", dir=a.dir)
    nvme_dir = os.path.join(work, "nvme")
    res_dir = os.path.join(work, "results")
    os.makedirs(nvme_dir)
    os.makedirs(res_dir)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(common.free_port()),
           os.path.abspath(__file__), "--worker", who, "--out", os.path.join(res_dir, "rank{rank}.json"),
           "--nvme-dir", nvme_dir, "--model", a.model, "--seq", str(a.seq), "--batch", str(a.batch),
           "--steps", str(a.steps), "--ds-buffer-size", str(a.ds_buffer_size),
           "--sub-group-size", str(a.sub_group_size)]
    t0 = time.perf_counter()
    try:
        # Its own session, so that a timeout ends torchrun and every rank it started.
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            # torchrun puts each rank in a session of its own: they are ended by their pids (each
            # wrote its own), torchrun by its group.
            for r in range(nproc):
                try:
                    with open(os.path.join(res_dir, f"rank{r}.json.pid")) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            return {"error": f"timed out after {a.timeout} s: " + tail(stderr or stdout, 8)}
        wall = time.perf_counter() - t0
        ranks = []
        for r in range(nproc):
            path = os.path.join(res_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
        errors = [r for r in ranks if "error" in r]
        if p.returncode != 0 or errors or len(ranks) != nproc:
            if errors:
                e = errors[0]
                why = f"rank {e['rank']}: {e['error']} | " + " | ".join(e.get("traceback", [])[-6:])
            else:
                why = tail(stderr or stdout)
            return {"error": f"exit {p.returncode}: {why}", "stderr_tail": tail(stderr or stdout, 30)}
        return {"ranks": ranks, "wall_s": wall, "omp_threads": per_rank_threads}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(r):
    """One run's figures over its ranks: the slowest rank's step, the largest RSS, the mean comm share."""
    ranks = r["ranks"]
    shares = [x.get("comm_share") for x in ranks]
    share = None if any(s is None for s in shares) else statistics.mean(shares)
    return {"step_s": max(x["step_s"] for x in ranks), "max_rss_bytes": max(x["max_rss_bytes"] for x in ranks),
            "comm_share": share, "init_s": max(x["init_s"] for x in ranks),
            "step_s_per_rank": [x["step_s"] for x in ranks], "rss_per_rank": [x["max_rss_bytes"] for x in ranks],
            "comm_share_per_rank": shares, "threads": ranks[0]["threads"],
            "losses_rank0": ranks[0]["losses"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default="/tmp", help="where each run's nvme and result directory is made (default /tmp)")
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="micro batch per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="threads in all; each rank gets max(1, threads // ranks)")
    p.add_argument("--ranks", default="1,2,3", help="tiermem's world sizes")
    p.add_argument("--ds-ranks", type=int, default=2, help="DeepSpeed's world size (0: no DeepSpeed run)")
    p.add_argument("--ds-buffer-size", type=float, default=4e7)
    p.add_argument("--sub-group-size", type=float, default=1e8)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--worker", choices=("tiermem", "deepspeed"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--nvme-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.ds_buffer_size = int(float(a.ds_buffer_size))
    a.sub_group_size = int(float(a.sub_group_size))
    if a.worker:
        return run_worker(a)

    tm_ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    who = [("tiermem", n) for n in tm_ranks] + ([("deepspeed", a.ds_ranks)] if a.ds_ranks > 0 else [])
    names = [f"{w}@{n}" for w, n in who]
    cpu, avx512 = common.cpu_name()
    print(f"CPU: {cpu} ({'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} logical CPUs; "
          f"OMP_NUM_THREADS=max(1, {a.threads} // ranks) OMP_WAIT_POLICY=PASSIVE per rank; "
          f"GPT-2 {a.model}, batch {a.batch} x seq {a.seq} per rank, fp32; nvme dir under {a.dir}", flush=True)
    runs = {c: [] for c in names}
    loads = []
    for rnd in range(a.rounds):
        k = rnd % len(who)
        for (w, n), c in zip(who[k:] + who[:k], names[k:] + names[:k]):
            la = common.loadavg()
            loads.append(la)
            r = spawn(a, w, n)
            r["loadavg_before"] = la
            if "error" in r:
                runs[c].append(r)
                print(f"round {rnd + 1} {c:12s} FAILED {r['error'][:600]}", flush=True)
                continue
            s = summarize(r)
            s.update(loadavg_before=la, wall_s=r["wall_s"], rss_marks=[x["rss_marks"] for x in r["ranks"]])
            runs[c].append(s)
            share = "-" if w == "deepspeed" else f"{s['comm_share']:.1%}"
            print(f"round {rnd + 1} {c:12s} step {s['step_s']:7.3f} s  max RSS {s['max_rss_bytes'] / 2**30:6.2f} GiB"
                  f"  comm {share:>6s}  init {s['init_s']:5.1f} s  load {la:.2f}"
                  f"  per rank {' '.join(f'{t:.3f}' for t in s['step_s_per_rank'])} s"
                  f"  losses {s['losses_rank0'][0]:.4f}..{s['losses_rank0'][-1]:.4f}", flush=True)

    results = {}
    for (w, n), c in zip(who, names):
        rs = runs[c]
        ok = [r for r in rs if "error" not in r]
        if not ok:
            results[c] = {"ranks": n, "error": rs[0]["error"] if rs else "not run"}
            continue
        shares = [r["comm_share"] for r in ok]
        results[c] = {"ranks": n, "step_s": statistics.median(r["step_s"] for r in ok),
                      "max_rss_bytes": statistics.median(r["max_rss_bytes"] for r in ok),
                      "comm_share": None if any(x is None for x in shares) else statistics.median(shares),
                      "init_s": statistics.median(r["init_s"] for r in ok), "threads_per_rank": ok[0]["threads"],
                      "rounds": len(ok), "step_s_each": [r["step_s"] for r in ok],
                      "step_s_per_rank": ok[0]["step_s_per_rank"], "rss_per_rank": ok[0]["rss_per_rank"],
                      "comm_share_per_rank": ok[0]["comm_share_per_rank"],
                      "first_loss": ok[0]["losses_rank0"][0], "last_loss": ok[0]["losses_rank0"][-1],
                      "rss_marks": ok[0]["rss_marks"]}
        if len(ok) < len(rs):
            results[c]["failed_rounds"] = [r["error"] for r in rs if "error" in r]

    def get(c, key):
        return results.get(c, {}).get(key)

    d = a.ds_ranks
    ratios = {}
    ds_step, tm_step = get(f"deepspeed@{d}", "step_s"), get(f"tiermem@{d}", "step_s")
    ds_rss, tm_rss = get(f"deepspeed@{d}", "max_rss_bytes"), get(f"tiermem@{d}", "max_rss_bytes")
    if d > 0:
        ratios[f"tiermem_vs_deepspeed_speed@{d}"] = ds_step / tm_step if ds_step and tm_step else None
        ratios[f"tiermem_vs_deepspeed_rss@{d}"] = tm_rss / ds_rss if ds_rss and tm_rss else None
    one = get("tiermem@1", "step_s")
    for n in tm_ranks:
        if n > 1 and 1 in tm_ranks:
            s = get(f"tiermem@{n}", "step_s")
            ratios[f"tiermem_weak_scaling@{n}"] = one / s if one and s else None

    print()
    print("| contender | ranks | threads/rank | step (s, median; slowest rank) | max RSS per rank (GiB) | "
          "comm share | init (s) |")
    print("|---|---|---|---|---|---|---|")
    for c, r in results.items():
        if "error" in r:
            print(f"| {c} | {r['ranks']} | | failed: {r['error'][:160].replace('|', '/')} | | | |")
            continue
        if c.startswith("deepspeed"):
            share = "-"
        else:
            share = f"{r['comm_share']:.1%}" + (" (no collectives)" if r["ranks"] == 1 else "")
        print(f"| {c} | {r['ranks']} | {r['threads_per_rank']} | {r['step_s']:.3f} | "
              f"{r['max_rss_bytes'] / 2**30:.2f} | {share} | {r['init_s']:.1f} |")
    for k, v in ratios.items():
        print(f"{k}: {'n/a' if v is None else f'{v:.2f}'}")
    print(f"load average (1 min) before runs: min {min(loads):.2f} median {statistics.median(loads):.2f} "
          f"max {max(loads):.2f}")
    if a.json:
        print(json.dumps({"results": results, "ratios": ratios, "loadavg": loads, "cpu": cpu, "avx512": avx512,
                          "threads": a.threads, "model": a.model, "seq": a.seq, "batch_per_rank": a.batch,
                          "steps": a.steps, "rounds": a.rounds, "tiermem_ranks": tm_ranks, "ds_ranks": a.ds_ranks}))


if __name__ == "__main__":
    main()
