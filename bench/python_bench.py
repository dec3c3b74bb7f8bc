#!/usr/bin/env python3
"""The Python face of tiermem, timed: aio_handle, CPUAdamW, NVMeAdamW (docs/benchmarks.md).

    make test-python        # makes the venv and installs tiermem into it
    OMP_WAIT_POLICY=PASSIVE ~/.cache/tiermem/venv/bin/python bench/python_bench.py \
        --dir /var/tmp/tm-pybench --reps 5

Sections (medians of --reps after one warm-up; every result is checked before it is timed):
  aio     tiermem.aio_handle driven as DeepSpeed's is: whole-file async_pwrite / async_pread of a
          new_cpu_locked_tensor, then wait(); --files files of --file-mib MiB each in flight.
  adam    one optimizer step over --params fp32 elements (4 tensors): torch.optim.AdamW
          (foreach), torch.optim.AdamW (fused), tiermem.torch.CPUAdamW.
  offload NVMeAdamW.step() (state on NVMe, --sub-group elements per sub-group, 4 staging buffers)
          against CPUAdamW.step() on the same parameters (state in host memory) and the same
          reads + writes with no compute ("io alone"), interleaved per repetition.
          overlap_efficiency = max(compute, io alone) / nvme step, as tiermem-bench zero-offload.
With --deepspeed (needs deepspeed in the venv, which setup.sh installs, and libaio-dev for its
async_io op; DS_ACCELERATOR=cpu is set; the ops are JIT-built on first use), the same run also
times DeepSpeed's aio_handle on the same files and DeepSpeedCPUAdam on the same parameters,
interleaved with tiermem's per repetition.
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch

import tiermem
from tiermem.torch import CPUAdamW, NVMeAdamW


def median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns, reps):
    """Medians of fns (name -> callable), one warm-up each, the order rotated per repetition."""
    names = list(fns)
    for name in names:
        fns[name]()
    times = {name: [] for name in names}
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_aio(args):
    h = tiermem.aio_handle(block_size=1 << 20, queue_depth=128)
    n = args.file_mib << 20
    bufs = [h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8)) for _ in range(args.files)]
    for i, b in enumerate(bufs):
        b.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    paths = [os.path.join(args.dir, f"aio{i}.bin") for i in range(args.files)]
    back = [h.new_cpu_locked_tensor(n, bufs[0]) for _ in range(args.files)]

    def write():
        for b, p in zip(bufs, paths):
            h.async_pwrite(b, p)
        assert h.wait() == len(paths)

    def read():
        for b, p in zip(back, paths):
            h.async_pread(b, p)
        assert h.wait() == len(paths)

    write()
    read()
    assert all(torch.equal(a, b) for a, b in zip(bufs, back))
    fns = {"tiermem write": write, "tiermem read": read}
    if args.deepspeed:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        d = AsyncIOBuilder().load().aio_handle(1 << 20, 128, False, True, 1)
        dbufs = [d.new_cpu_locked_tensor(n, bufs[0]) for _ in range(args.files)]
        for a, b in zip(dbufs, bufs):
            a.copy_(b)
        dpaths = [p + ".ds" for p in paths]

        def ds_write():
            for b, p in zip(dbufs, dpaths):
                d.async_pwrite(b, p)
            assert d.wait() == len(dpaths)

        def ds_read():
            for b in dbufs:
                b.zero_()
            for b, p in zip(dbufs, dpaths):
                d.async_pread(b, p)
            assert d.wait() == len(dpaths)

        ds_write()
        ds_read()
        assert all(torch.equal(a, b) for a, b in zip(dbufs, bufs))
        fns.update({"deepspeed write": ds_write, "deepspeed read": ds_read})
    t = interleaved(fns, args.reps)
    total = n * args.files
    line = (f"aio     engine {h.get_engine()}: {args.files} x {args.file_mib} MiB whole-file async  "
            f"tiermem write {total / t['tiermem write'] / 1e9:.2f} GB/s, read {total / t['tiermem read'] / 1e9:.2f} GB/s")
    if args.deepspeed:
        line += (f"; deepspeed write {total / t['deepspeed write'] / 1e9:.2f} GB/s, "
                 f"read {total / t['deepspeed read'] / 1e9:.2f} GB/s; tiermem/deepspeed "
                 f"write {t['deepspeed write'] / t['tiermem write']:.2f}x, read {t['deepspeed read'] / t['tiermem read']:.2f}x")
    print(line)


def params_of(total, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [total // 4] * 3 + [total - 3 * (total // 4)]
    ps = [torch.randn(s, generator=g).requires_grad_() for s in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def bench_adam(args):
    makers = {
        "torch.optim.AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch.optim.AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "tiermem.torch.CPUAdamW": lambda ps: CPUAdamW(ps, lr=1e-3),
    }
    if args.deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        makers["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=1e-2, adamw_mode=True)
    fns, params = {}, {}
    for name, make in makers.items():
        ps = params_of(args.params, 1)
        fns[name], params[name] = make(ps).step, ps
    t = interleaved(fns, args.reps)
    ref = params["tiermem.torch.CPUAdamW"]
    for name in fns:  # every optimizer stepped reps + 1 times from the same start
        diff = max((a - b).abs().max().item() for a, b in zip(params[name], ref))
        print(f"adam    {name:30s} {args.params / 1e6:.1f} M params: {t[name] * 1e3:8.1f} ms/step "
              f"({args.params / t[name] / 1e9:.2f} G params/s; max |param - CPUAdamW's| {diff:.1e})")


def bench_offload(args):
    ps_n, ps_h = params_of(args.params, 2), params_of(args.params, 2)
    d = os.path.join(args.dir, "offload")
    os.makedirs(d, exist_ok=True)
    nv = NVMeAdamW(ps_n, lr=1e-3, nvme_path=d, sub_group_size=args.sub_group, buffer_count=4)
    host = CPUAdamW(ps_h, lr=1e-3)
    nv.step()
    host.step()
    assert all(torch.equal(a, b) for a, b in zip(ps_n, ps_h)), "NVMe and host steps differ"

    order = list(range(len(nv._sub_groups)))

    def io_alone():
        nv._pipeline(order, lambda buf, i: None)

    t_nvme, t_host, t_io = [], [], []
    fns = [(nv.step, t_nvme), (host.step, t_host), (io_alone, t_io)]
    for r in range(args.reps):
        for k in range(3):  # rotate the order per repetition
            fn, out = fns[(r + k) % 3]
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    tn, th, ti = (statistics.median(x) for x in (t_nvme, t_host, t_io))
    moved = nv.nvme_bytes
    print(f"offload {args.params / 1e6:.1f} M params, {len(order)} sub-groups, state {moved / 2**20:.0f} MiB "
          f"read + written per step: nvme step {tn:.3f} s, compute (host state) {th:.3f} s, "
          f"io alone {ti:.3f} s ({2 * moved / ti / 1e9:.2f} GB/s); "
          f"overlap_efficiency {max(th, ti) / tn:.2f}")
    nv.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/tm-pybench")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--params", type=int, default=16 << 20)
    ap.add_argument("--sub-group", type=int, default=2 << 20)
    ap.add_argument("--only", choices=["aio", "adam", "offload"], default=None)
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's handle and CPU Adam")
    args = ap.parse_args()
    if args.deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.makedirs(args.dir, exist_ok=True)
    print(f"torch {torch.__version__}, tiermem adam kernel {tiermem.adam_isa()}, "
          f"threads {torch.get_num_threads()}, dir {args.dir}")
    if args.only in (None, "aio"):
        bench_aio(args)
    if args.only in (None, "adam"):
        bench_adam(args)
    if args.only in (None, "offload"):
        bench_offload(args)


if __name__ == "__main__":
    main()
