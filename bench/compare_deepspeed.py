#!/usr/bin/env python3
"""tiermem against DeepSpeed's own parts, side by side in one run: the NVMe engine and CPU Adam.

    python3 bench/compare_deepspeed.py                 # 5 rounds, every case (~15 min)
    python3 bench/compare_deepspeed.py --quick --json  # 3 rounds, fewer cases
    TIERMEM_BENCH=build/default/bin/tiermem-bench python3 bench/compare_deepspeed.py --dir /mnt/nvme

Cases (each measured in its own process, so one cannot warm the next):
  nvme  seq read / write, 1 MiB requests, O_DIRECT, on one file of --size bytes in --dir, at
        (qd 16, 1 thread) and (qd 32, 2 threads; qd is per thread):
          tiermem   tiermem-bench nvme (its buffers from the host pool, as training's are)
          deepspeed DeepSpeed's aio_handle(1 MiB, qd, single_submit=False, overlap_events=True,
                    threads): whole-file async_pread / async_pwrite of one new_cpu_locked_tensor,
                    repeated for --runtime seconds
          fio       fio ioengine=io_uring and ioengine=libaio, numjobs = threads, each job on
                    its own slice of the file, time_based --runtime
  adam  one AdamW step over one fp32 tensor of 64 M and 128 M parameters, 2 threads (--threads):
          tiermem   tiermem-bench adam (AVX-512/AVX2 by cpuid), with the fused bf16 copy-out and
                    without (--half none), and its same-run STREAM triad
          deepspeed DeepSpeedCPUAdam(adamw_mode=True)
          torch     torch.optim.AdamW(fused=True) and (foreach=True)
Rounds are interleaved and rotated (round r starts with the r-th contender); figures are medians
of the rounds; the load average (1 min) is recorded before every run. GB/s is 1e9 bytes/s.

The DeepSpeed and torch runs use a virtual environment outside the clone (TIERMEM_VENV, default
~/.cache/tiermem/venv; made with torch and deepspeed from PyPI when missing — that needs the
network), run by its Python's path (activating it could change which ninja JIT-builds
DeepSpeed's ops and trigger a rebuild). When DeepSpeed's async_io or cpu_adam op cannot be built
or loaded, those contenders are skipped with one line saying why; the rest still run.

--json prints one object as the last line: {"cases": {...medians...}, "<case>_vs_deepspeed": ratio
per case (tiermem / DeepSpeed, > 1 is faster), "loadavg": [...], ...}.
"""

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
MIB = 1 << 20


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


# ---------------------------------------------------------------- workers (run in the venv)

def worker_ds_aio(a):
    """DeepSpeed aio_handle: whole-file reads or writes for a.runtime seconds; prints GB/s."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    h = AsyncIOBuilder().load(verbose=False).aio_handle(MIB, a.qd, False, True, a.threads)
    buf = h.new_cpu_locked_tensor(a.size, torch.empty(0, dtype=torch.uint8))
    if a.rw == "write":
        buf.fill_(7)
    done, t0 = 0, time.perf_counter()
    while True:
        if a.rw == "read":
            h.async_pread(buf, a.file)
        else:
            h.async_pwrite(buf, a.file)
        if h.wait() != 1:
            raise SystemExit("deepspeed aio: wait() did not report one completed op")
        done += a.size
        if time.perf_counter() - t0 >= a.runtime:
            break
    gbps = done / (time.perf_counter() - t0) / 1e9
    h.free_cpu_locked_tensor(buf)
    print(json.dumps({"gbps": gbps}))


def worker_adam(a):
    """One optimizer over one tensor of a.params fp32 elements: median seconds per step."""
    import torch
    torch.set_num_threads(a.threads)
    n = a.params
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))
    p.grad = torch.full((n,), 0.01, dtype=torch.float32)
    if a.impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=1e-2, adamw_mode=True)
    elif a.impl == "torch-fused":
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, fused=True)
    else:
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, foreach=True)
    opt.step()  # warm-up, and the check: the first step from zero moves every weight by -lr
    if abs(float(p.data[n // 2]) + 1e-3) > 1e-6:
        raise SystemExit(f"{a.impl}: first step gave {float(p.data[n // 2])}, expected -1e-3")
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": statistics.median(times)}))


# ---------------------------------------------------------------- the driver

def venv_python(args):
    venv = os.environ.get("TIERMEM_VENV", os.path.expanduser("~/.cache/tiermem/venv"))
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        print(f"compare_deepspeed: making {venv} with torch and deepspeed from PyPI", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "torch", "deepspeed"], check=True)
    return py


def probe_ops(py, env):
    """Which DeepSpeed ops load (JIT-building them if needed): {"aio": why-not or None, ...}."""
    why = {}
    for key, code in (("aio", "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load(verbose=False)"),
                      ("adam", "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(verbose=False)"),
                      ("torch", "import torch")):
        r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True)
        why[key] = None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]
    return why


def run_json(cmd, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def fio_gbps(engine, rw, qd, threads, f, size, runtime):
    cmd = ["fio", "--name=cmp", f"--filename={f}", f"--ioengine={engine}", "--direct=1",
           f"--rw={rw}", "--bs=1M", f"--iodepth={qd}", f"--numjobs={threads}",
           f"--size={size // threads}", f"--offset_increment={size // threads}",
           f"--runtime={runtime}", "--time_based", "--group_reporting", "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    j = json.loads(r.stdout)["jobs"][0]
    return j["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, fewer cases")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; 3 with --quick)")
    ap.add_argument("--dir", default=None, help="where the test file goes (default: a temporary "
                    "directory under /var/tmp, removed at exit)")
    ap.add_argument("--size", default="1G", help="bytes of the test file (default 1G)")
    ap.add_argument("--runtime", type=float, default=3.0, help="seconds per NVMe run (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the Adam runs (default 2)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--only", choices=["nvme", "adam"], default=None, help="one section only")
    ap.add_argument("--worker", choices=["ds-aio", "adam"], help=argparse.SUPPRESS)
    ap.add_argument("--rw", default="read", help=argparse.SUPPRESS)
    ap.add_argument("--qd", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ds-aio":
        args.size = parse_size(args.size)
        return worker_ds_aio(args)
    if args.worker == "adam":
        return worker_adam(args)

    rounds = args.rounds or (3 if args.quick else 5)
    size = parse_size(args.size)
    bench = os.environ.get("TIERMEM_BENCH", os.path.join(HERE, "..", "build", "default", "bench", "tiermem-bench"))
    if not os.access(bench, os.X_OK):
        sys.exit(f"compare_deepspeed: {bench} is not built (make build, or set TIERMEM_BENCH)")
    have_fio = shutil.which("fio") is not None
    py = venv_python(args)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads),
               OMP_WAIT_POLICY="PASSIVE")
    why = probe_ops(py, env)
    for k, label in (("aio", "DeepSpeed async_io"), ("adam", "DeepSpeed cpu_adam"), ("torch", "torch")):
        if why[k]:
            print(f"compare_deepspeed: skipping {label}: it cannot be built or loaded here ({why[k]})")
    if not have_fio:
        print("compare_deepspeed: skipping fio: not installed")

    own_dir = args.dir is None
    d = tempfile.mkdtemp(prefix="tm-cmp-ds-", dir="/var/tmp") if own_dir else args.dir
    os.makedirs(d, exist_ok=True)
    f = os.path.join(d, "tiermem-cmp.dat")
    results, loads = {}, []

    def record(case, who, value):
        results.setdefault(case, {}).setdefault(who, []).append(value)

    try:
        if args.only in (None, "nvme"):
            # Lay the file out once (a sequential write, synced), so reads touch the device.
            with open(f, "wb") as out_f:
                chunk = bytes(range(256)) * (64 * MIB // 256)
                left = size
                while left > 0:
                    left -= out_f.write(chunk[:min(left, len(chunk))])
                out_f.flush()
                os.fsync(out_f.fileno())
            nvme_cases = [("read", 16, 1), ("write", 16, 1)]
            if not args.quick:
                nvme_cases += [("read", 32, 2), ("write", 32, 2)]
            for rw, qd, th in nvme_cases:
                case = f"seq_{rw}_qd{qd}_{th}t"
                who = [("tiermem", lambda: run_json([bench, "nvme", "--path", f, "--rw", rw, "--bs", "1M",
                                                     "--qd", str(qd), "--jobs", str(th), "--size", str(size),
                                                     "--runtime", str(args.runtime), "--json"])["gbps"])]
                if not why["aio"]:
                    who.append(("deepspeed", lambda: run_json(
                        [py, __file__, "--worker", "ds-aio", "--rw", rw, "--qd", str(qd), "--threads", str(th),
                         "--file", f, "--size", str(size), "--runtime", str(args.runtime)], env)["gbps"]))
                if have_fio:
                    who.append(("fio_io_uring", lambda: fio_gbps("io_uring", rw, qd, th, f, size, args.runtime)))
                    who.append(("fio_libaio", lambda: fio_gbps("libaio", rw, qd, th, f, size, args.runtime)))
                for r in range(rounds):
                    for k in range(len(who)):
                        name, fn = who[(k + r) % len(who)]
                        loads.append(os.getloadavg()[0])
                        record(case, name, fn())
                print(f"  {case}: " + ", ".join(f"{n} {statistics.median(v):.2f}" for n, v in results[case].items()),
                      flush=True)
        if args.only in (None, "adam"):
            sizes = [64 << 20] if args.quick else [64 << 20, 128 << 20]
            for n in sizes:
                case = f"adam_{n >> 20}M"
                bench_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))

                def tm(half):
                    j = run_json([bench, "adam", "--params", str(n), "--reps", "3", "--no-scalar",
                                  "--threads", str(args.threads), "--half", half, "--json"], bench_env)
                    record(case, f"triad_gbps_{half}", j["triad_gbps"])
                    return j["params_per_s"] / 1e6

                who = [("tiermem", lambda: tm("none")), ("tiermem_bf16", lambda: tm("bf16"))]
                workers = []
                if not why["adam"]:
                    workers.append("deepspeed")
                if not why["torch"]:
                    workers += ["torch-fused", "torch-foreach"]
                for impl in workers:
                    who.append((impl, lambda impl=impl: n / run_json(
                        [py, __file__, "--worker", "adam", "--impl", impl, "--params", str(n),
                         "--threads", str(args.threads), "--reps", "3"], env)["step_s"] / 1e6))
                for r in range(rounds):
                    for k in range(len(who)):
                        name, fn = who[(k + r) % len(who)]
                        loads.append(os.getloadavg()[0])
                        record(case, name, fn())
                print(f"  {case} (Mparam/s): " + ", ".join(
                    f"{n_} {statistics.median(v):.0f}" for n_, v in results[case].items() if not n_.startswith("triad")),
                    flush=True)
    finally:
        if own_dir:
            shutil.rmtree(d, ignore_errors=True)
        elif os.path.exists(f):
            os.unlink(f)

    med = {c: {w: statistics.median(v) for w, v in ws.items()} for c, ws in results.items()}
    out = {"rounds": rounds, "size": size, "threads_adam": args.threads, "cases": med,
           "loadavg": loads, "loadavg_median": statistics.median(loads) if loads else None,
           "skipped": {k: v for k, v in why.items() if v}}
    print(f"\n{'case':<22} {'tiermem':>9} {'deepspeed':>10} {'fio uring':>10} {'fio libaio':>10}"
          f" {'torch fused':>11} {'torch foreach':>13} {'tm/ds':>6}")
    for c, m in med.items():
        unit = "GB/s" if c.startswith("seq") else "Mparam/s"
        rows = [("tiermem", m.get("tiermem"))]
        if "tiermem_bf16" in m:
            rows.append(("tiermem+bf16", m["tiermem_bf16"]))
        for label, t in rows:
            ds = m.get("deepspeed")
            ratio = t / ds if ds and t else None
            key = c if label == "tiermem" else c + "_bf16"
            if ratio is not None:
                out[f"{key}_vs_deepspeed"] = ratio
            if c.startswith("seq") and m.get("fio_io_uring"):
                out[f"{key}_vs_fio_io_uring"] = t / m["fio_io_uring"]
            if c.startswith("adam"):
                tri = m.get("triad_gbps_none" if label == "tiermem" else "triad_gbps_bf16")
                if tri:
                    out[f"{key}_vs_triad"] = t * 1e6 * (28 if label == "tiermem" else 30) / 1e9 / tri

            def fmt(x, w):
                return f"{x:>{w}.2f}" if isinstance(x, float) and unit == "GB/s" else (
                    f"{x:>{w}.0f}" if isinstance(x, float) else f"{'-':>{w}}")
            print(f"{(c if label == 'tiermem' else c + ' +bf16'):<22} {fmt(t, 9)} {fmt(ds, 10)} "
                  f"{fmt(m.get('fio_io_uring'), 10)} {fmt(m.get('fio_libaio'), 10)} "
                  f"{fmt(m.get('torch-fused'), 11)} {fmt(m.get('torch-foreach'), 13)} "
                  f"{(f'{ratio:.2f}' if ratio else '-'):>6}  ({unit})")
    for c, m in med.items():
        if c.startswith("adam"):
            print(f"{c}: same-run triad {m.get('triad_gbps_none', 0):.1f} GB/s; tiermem/triad "
                  f"{out.get(c + '_vs_triad', 0):.2f} (28 B/param), +bf16 {out.get(c + '_bf16_vs_triad', 0):.2f} (30 B/param)")
    print(f"load average (1 min) over the runs: median {out['loadavg_median']}, max {max(loads) if loads else None}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
