#!/usr/bin/env python3
"""A 7 B Llama fine-tuned (PEFT LoRA) and served (generate) inside an 8 GiB memory cgroup:
tiermem.torch against DeepSpeed ZeRO-3, Hugging Face Accelerate's disk offload and plain torch.

    sudo ~/.cache/tiermem/venv/bin/python bench/llama7b_demo.py --json                 # the 7 B run (about an hour)
    sudo ~/.cache/tiermem/venv/bin/python bench/llama7b_demo.py --small --json         # the same logic in minutes
    sudo ~/.cache/tiermem/venv/bin/python bench/llama7b_demo.py --contenders tiermem_lora,accelerate_generate

Run as root (each contender runs in a fresh cgroup v1 memory group, largest_llama.run_in_cgroup)
with OMP_WAIT_POLICY=PASSIVE and without RANK/WORLD_SIZE in the environment.

The model: transformers.LlamaForCausalLM of Llama-2-7B's shape (hidden 4096, 32 layers,
intermediate 11008, 32 heads, 32 KV heads, vocab 32000, untied head: 6,738,415,616 parameters,
13.5 GB in bf16); --small is 2 layers, hidden 512, intermediate 1376, 8 heads (--layers, --hidden,
--intermediate, --heads override either). Its weights are written once, before the contenders
run, as a bf16 safetensors checkpoint in shards of --shard-bytes under --dir (every tensor drawn
from N(0, 0.02) by a generator seeded from --seed and the tensor's index, norms 1: the same weights
for every contender); config.json and model.safetensors.index.json beside them, as
save_pretrained writes them, so from_pretrained reads it.

Contenders, each in its own process inside a fresh memory cgroup of --cgroup-limit (default
8GiB; no swap), killed after --timeout seconds (default 1200), the checkpoint's pages dropped from
the page cache before each (POSIX_FADV_DONTNEED: pages cached outside the group would be memory
outside its limit, and from_pretrained maps the checkpoint's files as the weights):
  tiermem_lora         built under tiermem.torch.zero.Init in bf16 (transformers' no_init_weights:
                       as from_pretrained builds, no random init), the checkpoint's tensors written
                       into the Init store by load_state_dict one at a time, PEFT LoRA r 8 on q/v
                       (torch_bench_common.LORA), tiermem.torch.initialize with the ds_config below
                       (bf16; offload_param and offload_optimizer on nvme; tiermem host and device
                       budgets --budgets), --steps steps of batch --batch x seq --seq. Buffers keep
                       their dtype (the RoPE's inv_freq stays fp32), as in DeepSpeed 0.19.8
  tiermem_lora_budgets the same at the budgets --budgets2, --steps2 steps: its losses are compared
                       with tiermem_lora's bit for bit (budgets change no result)
  tiermem_generate     the same build and load, every parameter frozen, a forward-only engine (the
                       ds_config without its optimizer section), engine.module.generate() of
                       --new-tokens tokens, greedy, at batch 1 and 8 (prompts of --prompt tokens)
  accelerate_generate  from_pretrained(dtype bf16, device_map="auto", max_memory={"cpu":
                       --accelerate-cpu-memory}, offload_folder): Accelerate's big-model inference,
                       what does not fit in max_memory offloaded to disk; the same generate() calls
  deepspeed_lora       deepspeed.initialize (0.19.8, DS_ACCELERATOR=cpu, gloo, one rank), ZeRO-3,
                       the model loaded as DeepSpeed's HF users load it (HfDeepSpeedConfig, then
                       from_pretrained: built under deepspeed.zero.Init, loaded gathered), the same
                       LoRA and steps; once per configuration of --ds-variants (compare_torch.
                       DS_VARIANTS: swap buffers, prefetch off, max_in_cpu, offload_param on cpu; and
                       opt_cpu: offload_optimizer on cpu)
  torch_lora           the plain resident loop: from_pretrained in bf16, PEFT, torch.optim.AdamW
The ds_config (torch_bench_common.ds_config, as compare_torch.py --lora): stage 3, offload_param
{nvme, buffer_count 5, buffer_size the largest tensor rounded up to 1 Mi elements, max_in_cpu 1e9},
offload_optimizer {nvme, buffer_count 4}, sub_group_size 1e8, AdamW lr 1e-4, clipping 1.0, bucket
sizes as HF's "auto" derives them; bf16 enabled. tiermem's section: the budgets, and
nvme_read_gbps / nvme_write_gbps (--nvme-gbps, default 2.50,3.12: this machine's `tiermem-bench
profile`), which price the step's NVMe bytes: engine.stats()["io_bound_s"].

Per LoRA step: the wall time, the loss, max RSS (getrusage), the cgroup's max usage so far
(memory.max_usage_in_bytes, page cache included) and, for tiermem, the bound engine.stats() gives
for the same step: max(compute_s, io_bound_s), where compute_s = step_wall_s - stall_s (the
engine's step window minus the waits of the calling thread) and io_bound_s = the step's NVMe bytes
at the --nvme-gbps rates. Per generate: wall seconds, new tokens per second (batch x new tokens /
wall), the tokens, each forward pass's seconds; for tiermem, the NVMe bytes read (in all and by
pass) and their time at the read rate. A contender that dies is reported with how: OOM-killed (the
group's oom_kill count), timed out, or the exit code and the exception's last line, with the last
phase it reached and its max RSS there.

Disk: everything goes under --dir/llama7b_demo/ (default /tmp): the checkpoint and one folder per
contender, removed when the contender ends (also when it fails or is killed); what a killed run of
this script left there is removed at the start. --keep-checkpoint keeps the checkpoint (and a
later run with it reuses one of the same shape and seed).

--json prints one object as the last line. Not a test: `make test` does not run it.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch  # noqa: E402  (DeepSpeed's configurations: DS_VARIANTS, ds_variant)
import largest_llama  # noqa: E402  (the memory cgroup: run_in_cgroup, parse_bytes)
import torch_bench_common as common  # noqa: E402

LLAMA_7B = common.LLAMA_7B
SMALL = dict(LLAMA_7B, num_hidden_layers=2, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
             num_key_value_heads=8)
# offload_optimizer on cpu: the one DeepSpeed knob this script adds to compare_torch's list (in this
# process only).
compare_torch.DS_VARIANTS.setdefault("opt_cpu", {"offload_optimizer": {"device": "cpu"}})
DS_DEFAULT_VARIANTS = "base,buffers16,noprefetch,max_in_cpu0,buffers32+noprefetch,param_cpu,param_cpu+opt_cpu"
CONTENDERS = ("tiermem_lora", "tiermem_generate", "accelerate_generate", "deepspeed_lora", "torch_lora",
              "tiermem_lora_budgets")
INIT_STD = 0.02  # LlamaConfig's initializer_range


# ---------------------------------------------------------------- helpers of every process

def gib(x):
    return f"{x / 2**30:.2f}" if x is not None else "—"


def cgroup_usage():
    """(usage, max usage) of this process's cgroup v1 memory group, bytes; (None, None) outside one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(ln.split(":", 2)[2].strip() for ln in f if ln.split(":")[1] == "memory")
        group = os.path.join(largest_llama.CGROUP_ROOT, path.lstrip("/"))
        return (int(largest_llama.read(group, "memory.usage_in_bytes")),
                int(largest_llama.read(group, "memory.max_usage_in_bytes")))
    except (OSError, StopIteration, ValueError, IndexError):
        return (None, None)


def rss_anon_file():
    """[RssAnon, RssFile] of this process now, bytes (file-backed pages, a mapped checkpoint's, count
    in RSS too)."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("RssAnon:", "RssFile:")):
                out[ln.split(":")[0]] = int(ln.split()[1]) * 1024
    return [out.get("RssAnon", 0), out.get("RssFile", 0)]


def progress(a, phase, **kw):
    """A progress line on stdout (the driver reads the last one of a process that died) and in
    --dir's progress.log (to watch a long run)."""
    line = json.dumps({"progress": phase, "contender": a.worker, "max_rss_bytes": common.max_rss_bytes(),
                       "cgroup_max_usage_bytes": cgroup_usage()[1], "rss_anon_file": rss_anon_file(),
                       "t": time.time(), **kw})
    print(line, flush=True)
    with open(os.path.join(a.work, "progress.log"), "a") as f:
        f.write(line + "\n")


def shape_of(a):
    shape = dict(SMALL if a.small else LLAMA_7B)
    for k, v in (("num_hidden_layers", a.layers), ("hidden_size", a.hidden), ("intermediate_size", a.intermediate),
                 ("num_attention_heads", a.heads), ("num_key_value_heads", a.heads)):
        if v:
            shape[k] = v
    return shape


def ds_cfg(a, nvme_dir, budgets=None, optimizer=True, variant=None):
    """The run's ds_config (torch_bench_common.ds_config) in bf16: tiermem's section with `budgets`
    ("HOST,DEVICE") and the NVMe rates; DeepSpeed's configuration `variant`; no optimizer section
    for a forward-only engine."""
    shape = shape_of(a)
    largest = shape["vocab_size"] * shape["hidden_size"]
    read_gbps, write_gbps = (float(x) for x in a.nvme_gbps.split(","))
    tiermem = None
    if budgets:
        host, device = budgets.split(",")
        tiermem = {"host_budget_bytes": host, "device_budget_bytes": device, "nvme_read_gbps": read_gbps,
                   "nvme_write_gbps": write_gbps}
    cfg = common.ds_config(hidden=shape["hidden_size"], batch=a.batch, nvme_dir=nvme_dir, sub_group_size=int(1e8),
                           buffer_size=(largest + (1 << 20) - 1) // (1 << 20) * (1 << 20), tiermem=tiermem)
    cfg["bf16"] = {"enabled": True}
    if variant:
        cfg["zero_optimization"] = compare_torch.ds_variant(cfg["zero_optimization"], variant)
    if not optimizer:
        del cfg["optimizer"]
    return cfg


# ---------------------------------------------------------------- the checkpoint (a worker, outside any cgroup)

def checkpoint_ok(ckpt, shape, seed):
    try:
        with open(os.path.join(ckpt, "demo_shape.json")) as f:
            return json.load(f) == {"shape": shape, "seed": seed}
    except (OSError, ValueError):
        return False


def write_checkpoint(a):
    """The bf16 checkpoint every contender loads: config.json, shards of at most --shard-bytes,
    the index; demo_shape.json last (a checkpoint without it is incomplete)."""
    import torch
    from safetensors.torch import save_file
    transformers = common.import_transformers("LlamaForCausalLM")
    shape = shape_of(a)
    ckpt = a.ckpt
    os.makedirs(ckpt, exist_ok=True)
    config = common.llama_config(shape, a.seq)
    config.dtype = torch.bfloat16
    config.save_pretrained(ckpt)
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in transformers.LlamaForCausalLM(config).named_parameters()]
    shard, shard_bytes, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(ckpt, name), metadata={"format": "pt"})
        files.append(name)
        for k in shard:
            weight_map[k] = name
        shard, shard_bytes = {}, 0

    for i, (n, shp) in enumerate(names):
        if n.endswith("norm.weight"):
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + i)
            t = torch.empty(shp, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=g)
        if shard and shard_bytes + t.numel() * 2 > a.shard_bytes:
            flush()
        shard[n] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
    flush()
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(ckpt, "demo_shape.json"), "w") as f:
        json.dump({"shape": shape, "seed": a.seed}, f)
    print(json.dumps({"checkpoint": ckpt, "bytes": total, "shards": len(files), "tensors": len(names)}))


def checkpoint_tensors(ckpt):
    """(name, tensor) of every tensor of the checkpoint, one at a time, each read with pread into
    memory of its own (not safetensors' mmap: mapped file pages would count in the reader's RSS, and
    a tensor kept by reference would keep its pages mapped)."""
    import torch
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    for name in files:
        fd = os.open(os.path.join(ckpt, name), os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            header = json.loads(os.pread(fd, n, 8))
            for k, v in header.items():
                if k == "__metadata__":
                    continue
                begin, end = v["data_offsets"]
                t = torch.empty(v["shape"], dtype=dtypes[v["dtype"]])
                buf = memoryview(t.view(torch.uint8).reshape(-1).numpy())
                done = 0
                while done < end - begin:
                    got = os.preadv(fd, [buf[done:]], 8 + n + begin + done)
                    if got <= 0:
                        raise OSError(f"{name}: short read of {k}")
                    done += got
                yield k, t
        finally:
            os.close(fd)


# ---------------------------------------------------------------- the contenders (each in its own process)

def build_tiermem(a, cfg):
    """The Llama built under tiermem.torch.zero.Init in bf16 without random init (as from_pretrained
    builds), then the checkpoint's tensors written into the Init store one at a time."""
    import torch
    import tiermem.torch as tt
    transformers = common.import_transformers("LlamaForCausalLM")
    from transformers.initialization import no_init_weights
    config = common.llama_config(shape_of(a), a.seq)
    with tt.zero.Init(config=cfg), no_init_weights():
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    progress(a, "built")
    missing = set(n for n, _ in model.named_parameters())
    n = 0
    for name, t in checkpoint_tensors(a.ckpt):  # load_state_dict, one tensor at a time: into the Init store
        model.load_state_dict({name: t}, strict=False)
        missing.discard(name)
        n += 1
    if missing:
        raise RuntimeError(f"the checkpoint has no tensor for {sorted(missing)[:5]}")
    progress(a, "loaded", tensors=n)
    return model


def from_pretrained(a, **kw):
    import torch
    transformers = common.import_transformers("LlamaForCausalLM")
    return transformers.LlamaForCausalLM.from_pretrained(a.ckpt, dtype=torch.bfloat16, **kw)


def lora_steps(a, step, engine=None):
    """Runs --steps steps; a progress line after each (with tiermem's bound when `engine` is given)."""
    import torch
    out = {"steps": []}
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        s = {"step": i + 1, "step_s": dt, "loss": float(loss.item()), "max_rss_bytes": common.max_rss_bytes(),
             "cgroup_max_usage_bytes": cgroup_usage()[1]}
        if engine is not None:
            st = engine.stats()
            s.update({k: st[k] for k in ("step_wall_s", "stall_s", "compute_s", "io_bound_s",
                                         "last_step_nvme_read_bytes", "last_step_nvme_written_bytes")})
            s["bound_s"] = max(st["compute_s"], st["io_bound_s"])
        out["steps"].append(s)
        progress(a, "step", **s)
    out["losses"] = [s["loss"] for s in out["steps"]]
    out["loss_hex"] = [float(s["loss"]).hex() for s in out["steps"]]
    out["threads"] = torch.get_num_threads()
    return out


def prompts(a):
    import torch
    g = torch.Generator().manual_seed(a.seed + 1)
    return torch.randint(0, shape_of(a)["vocab_size"], (8, a.prompt), generator=g)


def generate_runs(a, model, engine=None):
    """generate() of --new-tokens tokens, greedy, at batch 1 and 8; tokens, seconds, tokens/s, each
    forward pass's seconds (and, for tiermem, the NVMe bytes read, in all and by pass, and their
    time at the read rate); a progress line per pass."""
    import torch
    ids = prompts(a)
    out = {}
    passes = []  # (perf_counter, NVMe bytes read so far) at the start and after each forward pass

    def pass_done(module, args, output):
        t, read = time.perf_counter(), engine.stats()["nvme_read_bytes"] if engine is not None else 0
        passes.append((t, read))
        if len(passes) > 1:
            progress(a, "pass", index=len(passes) - 1, seconds=t - passes[-2][0],
                     nvme_read_bytes=read - passes[-2][1])

    hook = model.register_forward_hook(pass_done)
    for b in (1, 8):
        x = ids[:b]
        before = engine.stats()["nvme_read_bytes"] if engine is not None else 0
        t0 = time.perf_counter()
        passes[:] = [(t0, before)]
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=a.new_tokens,
                               min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
        r = {"batch": b, "seconds": dt, "new_tokens": b * a.new_tokens, "tokens_per_s": b * a.new_tokens / dt,
             "tokens": y[:, x.shape[1]:].tolist(), "max_rss_bytes": common.max_rss_bytes(),
             "cgroup_max_usage_bytes": cgroup_usage()[1]}
        if engine is not None:
            st = engine.stats()
            r["nvme_read_bytes"] = st["nvme_read_bytes"] - before
            r["io_bound_s"] = r["nvme_read_bytes"] / (float(a.nvme_gbps.split(",")[0]) * 1e9)
            r["pass_read_bytes"] = [q[1] - p[1] for p, q in zip(passes, passes[1:])]
        r["pass_seconds"] = [q[0] - p[0] for p, q in zip(passes, passes[1:])]
        out[f"batch{b}"] = r
        progress(a, "generate", **r)
    hook.remove()
    return out


def run_worker(a):
    import torch
    torch.manual_seed(1)
    data = torch.randint(0, shape_of(a)["vocab_size"], (a.batch, a.seq))
    nvme_dir = os.path.join(a.work, a.worker.replace(":", "_"))
    os.makedirs(nvme_dir, exist_ok=True)
    w = a.worker
    out = {"contender": w}
    t0 = time.perf_counter()
    progress(a, "start")
    if w in ("tiermem_lora", "tiermem_lora_budgets", "tiermem_generate"):
        import tiermem.torch as tt
        gen = w == "tiermem_generate"
        budgets = a.budgets2 if w == "tiermem_lora_budgets" else a.budgets
        cfg = ds_cfg(a, nvme_dir, budgets=budgets, optimizer=not gen)
        out["budgets"] = budgets
        model = build_tiermem(a, cfg)
        if gen:
            model.requires_grad_(False)
        else:
            model = common.lora_wrap(model)
        engine, *_ = tt.initialize(model=model, config=cfg)
        out["init_s"] = time.perf_counter() - t0
        progress(a, "initialized", init_s=out["init_s"])
        if gen:
            engine.eval()
            out["generate"] = generate_runs(a, engine.module, engine)
        else:
            engine.train()
            if w == "tiermem_lora_budgets":
                a.steps = a.steps2
            out.update(lora_steps(a, lambda: common.engine_step(engine, data), engine))
        st = common.scalar_stats(engine)
        st.pop("phases", None)
        out["stats"] = st
        engine.close()
    elif w == "accelerate_generate":
        off = os.path.join(nvme_dir, "offload")
        model = from_pretrained(a, device_map="auto", max_memory={"cpu": int(a.accelerate_cpu_memory)},
                                offload_folder=off)
        where = list(getattr(model, "hf_device_map", {}).values())
        out["device_map"] = {d: where.count(d) for d in sorted(set(map(str, where)))}
        out["init_s"] = time.perf_counter() - t0
        progress(a, "initialized", init_s=out["init_s"], device_map=out["device_map"])
        model.eval()
        out["generate"] = generate_runs(a, model)
    elif w.startswith("deepspeed_lora"):
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig
        variant = w.split(":", 1)[1] if ":" in w else "base"
        cfg = ds_cfg(a, nvme_dir, variant=variant)
        out.update(deepspeed=deepspeed.__version__, ds_variant=variant, ds_zero_config=cfg["zero_optimization"])
        progress(a, "config", ds_variant=variant)
        common.init_deepspeed_gloo()
        keep = HfDeepSpeedConfig(cfg)  # noqa: F841  (from_pretrained builds under deepspeed.zero.Init while it lives)
        model = common.lora_wrap(from_pretrained(a))
        progress(a, "loaded")
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=[q for q in model.parameters() if q.requires_grad])
        out["init_s"] = time.perf_counter() - t0
        progress(a, "initialized", init_s=out["init_s"])
        out.update(lora_steps(a, lambda: common.engine_step(engine, data)))
    elif w == "torch_lora":
        model = common.lora_wrap(from_pretrained(a))
        progress(a, "loaded")
        step = common.plain_step(model, data, 1.0)
        out["init_s"] = time.perf_counter() - t0
        progress(a, "initialized", init_s=out["init_s"])
        out.update(lora_steps(a, step))
    else:
        raise SystemExit(f"unknown contender {w}")
    out["max_rss_bytes"] = common.max_rss_bytes()
    out["cgroup_max_usage_bytes"] = cgroup_usage()[1]
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- the driver

def how_it_died(rc_info, stderr, last):
    """One line: OOM-killed / timed out / exit and the exception's last line; where."""
    at = f" (last reached: {last['progress']})" if last else " before its first progress line"
    if last and last["progress"] == "step":
        at = f" after step {last.get('step')}"
    if last and last["progress"] == "generate":
        at = f" after generate at batch {last.get('batch')}"
    if last and last["progress"] == "pass":
        at = f" in generate, after forward pass {last.get('index')}"
    if rc_info.get("oom_kills"):
        return f"OOM-killed (memory cgroup oom_kill {rc_info['oom_kills']}){at}"
    if rc_info.get("timed_out"):
        return f"timed out after {rc_info['wall_s']:.0f} s{at}"
    lines = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
    exc = next((ln.strip() for ln in reversed(lines) if ln[:1].isalpha() and
                ("Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0])), lines[-1] if lines else "")
    return f"exit {rc_info.get('exit')}: {exc[:300]}{at}"


def drop_cached(ckpt):
    """Drops the checkpoint's pages from the page cache (POSIX_FADV_DONTNEED, its files only). A
    page is charged to the memory cgroup that first brought it in: pages cached by the writer or an
    earlier contender would be memory outside the next contender's group, and a model mapped from
    them (from_pretrained maps safetensors) would not count against its limit."""
    for name in os.listdir(ckpt):
        fd = os.open(os.path.join(ckpt, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_contender(a, who, limit, env):
    """One contender in its memory cgroup, the checkpoint's pages dropped from the page cache
    first; its folder under the work dir removed afterwards."""
    drop_cached(a.ckpt)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", who] + a.passthrough
    folder = os.path.join(a.work, who.replace(":", "_"))
    name = f"llama7b_demo_{os.getpid()}_{who.replace(':', '_').replace('+', '_')}"
    try:
        r = largest_llama.run_in_cgroup(cmd, env, limit, a.timeout, name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = []
    for ln in (r["stdout"] or "").splitlines():
        if ln.startswith("{"):
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    prog = [x for x in lines if "progress" in x]
    final = next((x for x in reversed(lines) if "progress" not in x), None)
    cg = {k: r[k] for k in ("exit", "wall_s", "cgroup_limit_bytes", "cgroup_max_usage_bytes", "cgroup_failcnt",
                            "oom_kills", "timed_out")}
    if r["rc"] == 0 and final is not None:
        res = dict(final, ok=True)
    else:
        last = prog[-1] if prog else None
        tail = [ln for ln in (r["stderr"] or "").strip().splitlines() if ln.strip()][-12:]
        res = {"contender": who, "ok": False, "died": how_it_died(r, r["stderr"], last), "stderr_tail": tail,
               "last_progress": last, "progress": prog,
               "max_rss_bytes_at_last_progress": last["max_rss_bytes"] if last else None}
    res["cgroup"] = cg
    return res


def report_line(r):
    c = r["contender"]
    if not r["ok"]:
        print(f"{c}: DIED: {r['died']}; max RSS at its last progress line "
              f"{gib(r.get('max_rss_bytes_at_last_progress'))} GiB; cgroup max usage "
              f"{gib(r['cgroup']['cgroup_max_usage_bytes'])} GiB", flush=True)
        for ln in r["stderr_tail"][-4:]:
            print(f"    {ln[:300]}", flush=True)
        return
    print(f"{c}: ran; init {r['init_s']:.0f} s; max RSS {gib(r['max_rss_bytes'])} GiB; cgroup max usage "
          f"{gib(r['cgroup']['cgroup_max_usage_bytes'])} GiB", flush=True)
    for s in r.get("steps", []):
        bound = (f"; bound max(compute {s['compute_s']:.1f}, I/O {s['io_bound_s']:.1f}) = {s['bound_s']:.1f} s "
                 f"({s['step_s'] / s['bound_s']:.2f}x)" if "bound_s" in s and s["bound_s"] > 0 else "")
        print(f"    step {s['step']}: {s['step_s']:.1f} s{bound}; loss {s['loss']:.6f}; max RSS "
              f"{gib(s['max_rss_bytes'])} GiB; cgroup max {gib(s['cgroup_max_usage_bytes'])} GiB", flush=True)
    for g in (r.get("generate") or {}).values():
        io = (f"; NVMe read {g['nvme_read_bytes'] / 1e9:.1f} GB, I/O bound {g['io_bound_s']:.1f} s"
              if "io_bound_s" in g else "")
        print(f"    generate batch {g['batch']}: {g['new_tokens']} tokens in {g['seconds']:.1f} s = "
              f"{g['tokens_per_s']:.3f} tokens/s{io}; max RSS {gib(g['max_rss_bytes'])} GiB", flush=True)
    if "device_map" in r:
        print(f"    device_map: {r['device_map']} (modules per place)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--small", action="store_true", help="2 layers, hidden 512, intermediate 1376, 8 heads")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="attention heads (and KV heads)")
    p.add_argument("--seq", type=int, default=64, help="LoRA sequence length (default 64)")
    p.add_argument("--batch", type=int, default=1, help="LoRA micro-batch (default 1)")
    p.add_argument("--steps", type=int, default=3, help="LoRA steps (default 3)")
    p.add_argument("--steps2", type=int, default=2, help="tiermem_lora_budgets' steps (default 2)")
    p.add_argument("--prompt", type=int, default=16, help="generate: prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int, default=16, help="generate: new tokens (default 16)")
    p.add_argument("--cgroup-limit", default="8GiB", help="each contender's memory cgroup (default 8GiB)")
    p.add_argument("--budgets", default="2GiB,1GiB", help="tiermem host,device budgets (default 2GiB,1GiB)")
    p.add_argument("--budgets2", default="1GiB,512MiB",
                   help="tiermem_lora_budgets' host,device budgets (default 1GiB,512MiB)")
    p.add_argument("--nvme-gbps", default="2.50,3.12",
                   help="NVMe read,write GB/s for tiermem's I/O bound (default: this machine's tiermem-bench profile)")
    p.add_argument("--accelerate-cpu-memory", default=None,
                   help="Accelerate's max_memory['cpu'] (default: the cgroup limit less 3 GiB)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"default {','.join(CONTENDERS)}")
    p.add_argument("--ds-variants", default=DS_DEFAULT_VARIANTS,
                   help=f"DeepSpeed's configurations, each run (default {DS_DEFAULT_VARIANTS})")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per contender (default 1200)")
    p.add_argument("--dir", default="/tmp", help="where llama7b_demo/ is made (default /tmp)")
    p.add_argument("--seed", type=int, default=0, help="the checkpoint's seed (default 0)")
    p.add_argument("--shard-bytes", type=float, default=2e9, help="checkpoint shard size (default 2e9)")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint (and reuse a matching one)")
    common.add_worker_flags(p)
    a = p.parse_args()
    if a.worker:
        a.ckpt = os.path.join(a.work, "ckpt")
        return write_checkpoint(a) if a.worker == "checkpoint" else run_worker(a)

    limit = largest_llama.parse_bytes(a.cgroup_limit)
    if a.accelerate_cpu_memory is None:
        a.accelerate_cpu_memory = max(limit - 3 * 2**30, limit // 4)
    else:
        a.accelerate_cpu_memory = largest_llama.parse_bytes(a.accelerate_cpu_memory)
    if not largest_llama.cgroup_available():
        raise SystemExit(f"llama7b_demo: {largest_llama.CGROUP_ROOT} is not writable (root and the cgroup v1 "
                         "memory controller are needed)")
    a.work = os.path.join(os.path.abspath(a.dir), "llama7b_demo")
    a.ckpt = os.path.join(a.work, "ckpt")
    shape = shape_of(a)
    # A killed run's leftovers: everything in the work dir (the checkpoint too, unless it is kept and whole).
    keep_ckpt = a.keep_checkpoint and checkpoint_ok(a.ckpt, shape, a.seed)
    if os.path.isdir(a.work):
        for e in os.listdir(a.work):
            if not (e == "ckpt" and keep_ckpt):
                shutil.rmtree(os.path.join(a.work, e), ignore_errors=True)
                if os.path.exists(os.path.join(a.work, e)):
                    os.remove(os.path.join(a.work, e))
    os.makedirs(a.work, exist_ok=True)
    a.passthrough = ["--work", a.work, "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps),
                     "--steps2", str(a.steps2), "--prompt", str(a.prompt), "--new-tokens", str(a.new_tokens),
                     "--budgets", a.budgets, "--budgets2", a.budgets2, "--nvme-gbps", a.nvme_gbps,
                     "--accelerate-cpu-memory", str(a.accelerate_cpu_memory), "--seed", str(a.seed)]
    for flag, v in (("--layers", a.layers), ("--hidden", a.hidden), ("--intermediate", a.intermediate),
                    ("--heads", a.heads)):
        if v:
            a.passthrough += [flag, str(v)]
    if a.small:
        a.passthrough.append("--small")
    env = common.worker_env(a.threads, single_rank=True)

    n = common.llama_param_count(shape)
    cpu, avx512 = common.cpu_name()
    with open("/proc/cpuinfo") as f:
        bf16 = " avx512_bf16" in f.read()
    print(f"CPU: {cpu} ({'AVX-512' if avx512 else 'no AVX-512'}{', avx512_bf16' if bf16 else ''}), "
          f"{os.cpu_count()} logical CPUs; OMP_NUM_THREADS={a.threads}", flush=True)
    print(f"Llama {shape}: {n:,} parameters, {2 * n / 1e9:.2f} GB in bf16; LoRA {common.LORA}; batch {a.batch} x seq "
          f"{a.seq}, {a.steps} steps; generate {a.new_tokens} tokens after {a.prompt}, greedy, batch 1 and 8; "
          f"memory cgroup {gib(limit)} GiB; work dir {a.work}", flush=True)
    results, loads = {}, []
    try:
        t0 = time.perf_counter()
        if keep_ckpt:
            print(f"checkpoint: reusing {a.ckpt}", flush=True)
        else:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "checkpoint"] + a.passthrough,
                               env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"llama7b_demo: writing the checkpoint failed: {r.stderr.strip()[-2000:]}")
            print(f"checkpoint: {r.stdout.strip().splitlines()[-1]} in {time.perf_counter() - t0:.0f} s", flush=True)
        who = []
        for c in [x.strip() for x in a.contenders.split(",") if x.strip()]:
            if c == "deepspeed_lora":
                who += [f"deepspeed_lora:{v.strip()}" for v in a.ds_variants.split(",") if v.strip()]
            else:
                who.append(c)
        for c in who:
            loads.append(common.loadavg())
            print(f"--- {c} (load average {loads[-1]:.2f}, {time.strftime('%H:%M:%S')})", flush=True)
            results[c] = run_contender(a, c, limit, env)
            results[c]["loadavg_before"] = loads[-1]
            report_line(results[c])
    finally:
        if not a.keep_checkpoint:
            shutil.rmtree(a.ckpt, ignore_errors=True)
    summary = summarize(a, results)
    if a.json:
        print(json.dumps({"shape": shape, "params": n, "lora": common.LORA, "seq": a.seq, "batch": a.batch,
                          "steps": a.steps, "new_tokens": a.new_tokens, "prompt": a.prompt, "cgroup_limit_bytes": limit,
                          "budgets": a.budgets, "budgets2": a.budgets2, "nvme_gbps": a.nvme_gbps,
                          "accelerate_cpu_memory": a.accelerate_cpu_memory, "cpu": cpu, "avx512": avx512,
                          "avx512_bf16": bf16, "threads": a.threads, "loadavg": loads, "date": time.strftime("%F %T %Z"),
                          "results": results, "summary": summary}))


def summarize(a, results):
    """The table, the token comparison and the budgets' loss comparison."""
    print()
    print("| contender | outcome | step (s, median) | tokens/s batch 1 / 8 | max RSS (GiB) | cgroup max usage (GiB) |")
    print("|---|---|---|---|---|---|")
    for c, r in results.items():
        cg = gib(r["cgroup"]["cgroup_max_usage_bytes"])
        if not r["ok"]:
            print(f"| {c} | {r['died']} | | | {gib(r.get('max_rss_bytes_at_last_progress'))} at it | {cg} |")
            continue
        step = f"{statistics.median(s['step_s'] for s in r['steps']):.1f}" if r.get("steps") else ""
        gen = r.get("generate") or {}
        tps = " / ".join(f"{gen[k]['tokens_per_s']:.3f}" for k in ("batch1", "batch8") if k in gen)
        print(f"| {c} | ran | {step} | {tps} | {gib(r['max_rss_bytes'])} | {cg} |")
    out = {}
    tg, ag = results.get("tiermem_generate", {}), results.get("accelerate_generate", {})
    if tg.get("ok") and ag.get("ok"):
        for k in ("batch1", "batch8"):
            x, y = tg["generate"][k]["tokens"], ag["generate"][k]["tokens"]
            out[f"tokens_same_{k}"] = x == y
            diff = [(i, j) for i in range(len(x)) for j in range(len(x[i])) if x[i][j] != y[i][j]]
            print(f"generate {k}: tiermem's tokens {'==' if x == y else '!='} Accelerate's" +
                  (f": {len(diff)} of {sum(map(len, x))} differ, the first at row {diff[0][0]} position {diff[0][1]}: "
                   f"{x[diff[0][0]]} vs {y[diff[0][0]]}" if diff else ""))
            out[f"tokens_per_s_ratio_{k}"] = tg["generate"][k]["tokens_per_s"] / ag["generate"][k]["tokens_per_s"]
            print(f"generate {k}: tiermem {out[f'tokens_per_s_ratio_{k}']:.2f}x Accelerate's tokens/s")
    t1, t2 = results.get("tiermem_lora", {}), results.get("tiermem_lora_budgets", {})
    if t1.get("ok") and t2.get("ok"):
        n = min(len(t1["loss_hex"]), len(t2["loss_hex"]))
        same = t1["loss_hex"][:n] == t2["loss_hex"][:n]
        out["losses_same_across_budgets"] = same
        print(f"losses at budgets {a.budgets}: {t1['loss_hex'][:n]}")
        print(f"losses at budgets {a.budgets2}: {t2['loss_hex'][:n]}  -> {'identical' if same else 'DIFFERENT'}")
    pl = results.get("torch_lora", {})
    if t1.get("ok") and pl.get("ok"):
        n = min(len(t1["losses"]), len(pl["losses"]))
        print(f"losses tiermem {t1['losses'][:n]} vs plain torch {pl['losses'][:n]}")
    return out


if __name__ == "__main__":
    main()
