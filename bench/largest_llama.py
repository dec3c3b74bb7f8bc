#!/usr/bin/env python3
"""The largest Llama that trains inside a memory cgroup: tiermem.torch against DeepSpeed ZeRO-3.

    sudo ~/.cache/tiermem/venv/bin/python bench/largest_llama.py --dir /mnt/nvme          # tiermem, 6 GiB
    sudo ~/.cache/tiermem/venv/bin/python bench/largest_llama.py --contender deepspeed --dir /mnt/nvme
    sudo ~/.cache/tiermem/venv/bin/python bench/largest_llama.py --layers 4 --hidden 1024 --limit 4GiB

Model: transformers.LlamaForCausalLM from a LlamaConfig (default: TinyLlama-1.1B's shape, hidden
2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000: 1.10 B parameters), built
under the contender's zero.Init (tiermem.torch.zero.Init; DeepSpeed through HfDeepSpeedConfig and
from_config, as HF users build it) under a fixed seed, no download; one random token batch of
--batch x --seq (1 x 128); fp32; AdamW lr 1e-4, clipping 1.0; stage 3 with offload_param and
offload_optimizer on nvme in a fresh directory under --dir; --steps steps (default 2).

The worker runs in a fresh cgroup v1 memory group (/sys/fs/cgroup/memory/<name>, needs root) with
memory.limit_in_bytes = --limit (default 6 GiB); swap is not given to it (memsw limit the same when
the kernel has it). Afterwards: the worker's exit (a kill by the OOM killer shows as signal 9 and an
oom_kill count), its max RSS (getrusage, if it finished), the group's max usage (which counts page
cache too), the step times and losses. Without a writable cgroup v1 memory controller it says so and
stops.

tiermem budgets: --host-budget and --device-budget (default 1 GiB each: the engine's defaults on a
CPU-only build), written into the config's tiermem section. ds_config (torch_bench_common.ds_config,
as compare_torch.py's): offload_param buffer_count 5 with buffer_size the largest tensor rounded up
to 1 Mi elements (embed_tokens / lm_head), max_in_cpu 1e9, sub_group_size 1e8, pin_memory false,
aio block 1 MiB / queue depth 8.
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
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_bench_common as common  # noqa: E402

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def parse_bytes(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[:-len(u)]) * units[u])
    return int(float(t))


def llama_config(a):
    transformers = common.import_transformers()
    return transformers.LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate,
                                    num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                    num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                                    max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False)


def ds_config(a, nvme_dir, tiermem=True):
    largest = a.vocab * a.hidden
    return common.ds_config(hidden=a.hidden, batch=a.batch, nvme_dir=nvme_dir, sub_group_size=1e8,
                            buffer_size=(largest + (1 << 20) - 1) // (1 << 20) * (1 << 20),
                            tiermem={"host_budget_bytes": a.host_budget, "device_budget_bytes": a.device_budget}
                            if tiermem else None)


# ---------------------------------------------------------------- the worker (inside the cgroup)

def run_worker(a):
    import torch
    transformers = common.import_transformers("LlamaForCausalLM")  # before any zero.Init
    max_rss = common.max_rss_bytes
    nvme_dir = tempfile.mkdtemp(prefix=f"largest_llama_{a.contender}_", dir=a.dir)
    out = {"contender": a.contender}
    try:
        t0 = time.perf_counter()
        if a.contender == "tiermem":
            import tiermem.torch as tt
            cfg = ds_config(a, nvme_dir)
            torch.manual_seed(0)
            with tt.zero.Init(config=cfg):
                model = transformers.LlamaForCausalLM(llama_config(a))
            out["build_s"] = time.perf_counter() - t0
            print(json.dumps({"progress": "built", **out, "max_rss_bytes": max_rss()}), flush=True)
            engine, *_ = tt.initialize(model=model, config=cfg)
        else:
            import deepspeed
            cfg = ds_config(a, nvme_dir, tiermem=False)
            common.init_deepspeed_gloo()
            model, keep = common.build_under_deepspeed(  # noqa: F841  (kept alive)
                transformers.LlamaForCausalLM, llama_config(a), cfg)
            out["build_s"] = time.perf_counter() - t0
            print(json.dumps({"progress": "built", **out, "max_rss_bytes": max_rss()}), flush=True)
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out["params"] = sum(p.numel() if p.numel() > 1 else getattr(p, "ds_numel", 1) for p in model.parameters())
        out["init_s"] = time.perf_counter() - t0
        print(json.dumps({"progress": "initialized", **out, "max_rss_bytes": max_rss()}), flush=True)
        torch.manual_seed(1)
        data = torch.randint(0, a.vocab, (a.batch, a.seq))

        def progress(i, seconds, loss):
            print(json.dumps({"progress": "step", "step_s": seconds, "loss": loss}), flush=True)

        times, losses = common.timed_steps(lambda: common.engine_step(engine, data), a.steps, after=progress)
        out.update(step_times=times, losses=losses, max_rss_bytes=max_rss())
        if a.contender == "tiermem":
            st = engine.stats()
            out["stats"] = {k: st[k] for k in ("param_home", "optimizer_home", "gradient_home", "host_pool_peak_bytes",
                                                "device_peak_bytes", "nvme_read_bytes", "nvme_written_bytes")}
            engine.close()
        print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


# ---------------------------------------------------------------- the memory cgroup (also compare_torch.py --lora --cgroup-limit)

def read(group: str, name: str) -> str:
    try:
        with open(os.path.join(group, name)) as f:
            return f.read().strip()
    except OSError:
        return ""


def cgroup_available() -> bool:
    """Whether a cgroup v1 memory group can be made here (root and the controller mounted)."""
    return os.access(CGROUP_ROOT, os.W_OK)


# memory.stat fields sampled while the worker runs (bytes): anonymous memory, page cache, and of
# the page cache what is dirty or under writeback (what the group cannot drop without writing).
STAT_FIELDS = ("rss", "cache", "dirty", "writeback", "mapped_file")


def memory_stat(group: str) -> dict:
    """The group's memory.stat fields of STAT_FIELDS (bytes), and its usage now (usage_bytes)."""
    out = {}
    for ln in read(group, "memory.stat").splitlines():
        k, _, v = ln.partition(" ")
        if k in STAT_FIELDS:
            out[k] = int(v)
    out["usage_bytes"] = int(read(group, "memory.usage_in_bytes") or 0)
    return out


class GroupSampler:
    """Samples a memory group's usage and memory.stat every `period_s` seconds on its own thread
    (started by start(), stopped by stop()) while the group has a task: the sample at the highest
    usage seen (at_peak) and the last one taken (last: the group's state at most period_s before
    its task ended, or was killed).
    Owns the thread; read the results only after stop()."""

    def __init__(self, group: str, period_s: float = 0.1) -> None:
        self.group, self.period_s = group, period_s
        self.at_peak = self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            alive = bool(read(self.group, "cgroup.procs"))  # read first: a sample taken after death is not kept
            s = memory_stat(self.group)
            if alive and s.get("usage_bytes"):
                s["t_s"] = time.perf_counter()
                self.last = s
                if self.at_peak is None or s["usage_bytes"] >= self.at_peak["usage_bytes"]:
                    self.at_peak = s
            self._stop.wait(self.period_s)

    def start(self) -> "GroupSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_in_cgroup(cmd, env, limit, timeout, name):
    """Runs cmd in a fresh cgroup v1 memory group CGROUP_ROOT/name with memory.limit_in_bytes =
    limit (and memsw the same when the kernel has it: no swap), waits up to timeout seconds (then
    kills it), removes the group. Returns {rc, exit ("signal SIGKILL" for a kill), wall_s,
    cgroup_limit_bytes, cgroup_max_usage_bytes (memory.max_usage_in_bytes: the group's peak,
    page cache included; cgroup v1 has no memory.peak), cgroup_failcnt, oom_kills, timed_out,
    cgroup_at_peak / cgroup_last (GroupSampler every 0.1 s: memory.stat's rss (anonymous), cache,
    dirty, writeback, mapped_file and usage_bytes at the highest usage sampled, and in the last
    sample: how the group stood when its task died), stdout, stderr}."""
    group = os.path.join(CGROUP_ROOT, name)
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        if os.path.exists(os.path.join(group, "memory.memsw.limit_in_bytes")):
            with open(os.path.join(group, "memory.memsw.limit_in_bytes"), "w") as f:
                f.write(str(limit))

        def enter_group():
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=enter_group)
        sampler = GroupSampler(group).start()
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            stdout, stderr = proc.communicate()
        finally:
            sampler.stop()
        wall = time.perf_counter() - t0
        rc = proc.returncode
        oom = read(group, "memory.oom_control")
        for s in (sampler.at_peak, sampler.last):
            if s is not None:
                s["t_s"] = round(s["t_s"] - t0, 2)  # seconds after the start
        return {"rc": rc, "exit": rc if rc >= 0 else f"signal {signal.Signals(-rc).name}", "wall_s": wall,
                "cgroup_limit_bytes": limit,
                "cgroup_max_usage_bytes": int(read(group, "memory.max_usage_in_bytes") or 0),
                "cgroup_failcnt": int(read(group, "memory.failcnt") or 0),
                "oom_kills": next((int(x.split()[1]) for x in oom.splitlines() if x.startswith("oom_kill ")), None),
                "cgroup_at_peak": sampler.at_peak, "cgroup_last": sampler.last,
                "timed_out": timed_out, "stdout": stdout, "stderr": stderr}
    finally:
        for _ in range(50):  # the group can be removed once its last task has gone
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)


# ---------------------------------------------------------------- the driver (outside it)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contender", choices=("tiermem", "deepspeed"), default="tiermem")
    p.add_argument("--dir", default="/tmp", help="where the run's nvme directory is made")
    p.add_argument("--limit", default="6GiB", help="the cgroup's memory.limit_in_bytes")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--host-budget", default="1GiB")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return run_worker(a)

    if not cgroup_available():
        raise SystemExit(f"largest_llama: {CGROUP_ROOT} is not writable (needs root and the cgroup v1 memory "
                         "controller); run as root, or use systemd-run --scope -p MemoryMax=6G on the worker")
    free = shutil.disk_usage(a.dir).free
    limit = parse_bytes(a.limit)
    print(f"largest_llama: {a.contender}, LlamaConfig(hidden {a.hidden}, intermediate {a.intermediate}, "
          f"layers {a.layers}, heads {a.heads}/{a.kv_heads}, vocab {a.vocab}), batch {a.batch} x seq {a.seq}, "
          f"fp32, cgroup limit {limit / 2**30:.2f} GiB, nvme dir under {a.dir} ({free / 2**30:.0f} GiB free)",
          flush=True)
    r = run_in_cgroup([sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:],
                      common.worker_env(a.threads), limit, a.timeout, f"largest_llama_{os.getpid()}")
    lines = [json.loads(ln) for ln in r.pop("stdout").splitlines() if ln.startswith("{")]
    final = next((x for x in reversed(lines) if "progress" not in x), None)
    stderr = r.pop("stderr")
    summary = {"contender": a.contender, **r, "progress": [x for x in lines if "progress" in x]}
    if final is not None:
        summary.update(final)
        if final.get("step_times"):
            summary["step_s_median"] = statistics.median(final["step_times"])
    if r["rc"] != 0:
        summary["stderr_tail"] = [ln for ln in stderr.strip().splitlines() if not ln.startswith("[transformers]")][-8:]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
