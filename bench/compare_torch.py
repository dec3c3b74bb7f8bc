#!/usr/bin/env python3
"""Training a Hugging Face GPT-2 on the CPU: tiermem.torch against DeepSpeed ZeRO-3 and plain PyTorch.

    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py                 # 2 rounds, GPT-2 124 M
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --rounds 3 --json --dir /mnt/nvme
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --model medium --contenders deepspeed,tiermem
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --profile tiermem   # where its time goes
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --llama 1b --rounds 3 --steps 5 --contenders deepspeed,tiermem_init,torch
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --lora --llama 1b --rounds 1 --json    # PEFT LoRA
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --lora --llama 1b --cgroup-limit half --json
    ~/.cache/tiermem/venv/bin/python bench/compare_torch.py --contenders tiermem,tiermem_init --plan-check me.json

Model: transformers.GPT2LMHeadModel from GPT2Config (--model small: the defaults, n_layer 12,
n_embd 768, vocab 50257, 124 M parameters; --model medium: n_layer 24, n_embd 1024, 355 M), built
under a fixed seed (no download); one fixed random token batch of --batch x --seq (default 1 x
128) as input_ids and labels; fp32; AdamW lr 1e-4, weight decay 0.01, clipping --clip (1.0). --llama PRESET
(without --lora): the same full training of transformers.LlamaForCausalLM of that shape
(torch_bench_common.LLAMA_SHAPES; 1b: TinyLlama-1.1B's, 1.10 B parameters, untied head) instead of
GPT-2, built under each contender's zero.Init as below; offload_param's buffer_size is then the
larger of --ds-buffer-size and the largest tensor rounded up to 1 Mi elements. --ds-variant NAME
applies one of DS_VARIANTS to DeepSpeed's config (Llama 1b needs buffers16: with 5 swap buffers
DeepSpeed 0.19.8 asserts "Not enough buffers 0 for swapping 1" in its first forward).

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
                same ds_config; tiermem_init@SIZE: the same at host and device budgets of SIZE each
                (e.g. tiermem_init@1GiB beside tiermem_init in one interleaved run); a contender
                tiermem...+ub: the same with tiermem.update_in_backward (it applies with --clip 0)
  tiermem:DTYPE, tiermem_init:DTYPE (--lora): the same with the frozen base stored DTYPE at rest
                (tiermem.frozen_dtype bf16 or int8, dequantized at gather), e.g. --contenders
                tiermem_init,tiermem_init:bf16,tiermem_init:int8; the report adds each one's loss
                difference, step time and max RSS against the contender without the suffix
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

--lora: the LoRA workload (issue 40). transformers.LlamaForCausalLM of --llama (torch_bench_common.
LLAMA_SHAPES: tiny, 2 layers, hidden 256, intermediate 688, 4 heads, vocab 32000, 18.0 M parameters,
seconds a step; 1b, TinyLlama-1.1B's shape, 1.10 B; --llama-layers / --llama-hidden /
--llama-intermediate override the preset), untied head, built under each contender's zero.Init
(tiermem.torch.zero.Init; DeepSpeed through HfDeepSpeedConfig + from_config) under a fixed seed,
then peft.get_peft_model(LoraConfig(r=8, lora_alpha=16, lora_dropout=0, target_modules=[q_proj,
v_proj])) (the adapters made outside any Init, under seed 2); batch 1 x seq 128, fp32, params and
optimizer on nvme (buffer_size the largest tensor rounded up to 1 Mi elements, as largest_llama.py).
Contenders (default deepspeed,tiermem,torch; tiermem_init too): deepspeed.initialize with the
trainable parameters; tiermem.torch.initialize; the plain PEFT model with torch.optim.AdamW on its
trainable parameters. Per contender: step time (median of steps 3..), max RSS, NVMe bytes per
measured step from /proc/self/io (read_bytes / write_bytes: storage I/O of the whole process) and,
for tiermem, engine.stats()'s nvme_{read,written}_{frozen,trainable,optimizer}_bytes, losses; and
step by step (a "by step" line per tiermem round; --json: each_step_each, one list per round), each
step's time and, for tiermem, its NVMe reads, the calling thread's waits (driving_stall_ns) and the
Prefetcher's hints (prefetch_hints; prefetch_hints_recording: given while the step recorded its
order, by the modules' registration order or the previous step's).
DeepSpeed fails on this workload in 0.19.8 (a swap-buffer assertion in the forward that follows
the traced first step): --ds-variants lists configurations (DS_VARIANTS: buffer_count, max_in_cpu,
stage3_prefetch_bucket_size 0, max_live_parameters, offload_param on cpu) tried in order until one
runs (--ds-try-all: every one); each attempt (configuration, error, steps done) goes to the output
and to "ds_attempts" in --json; later rounds use the one that ran.
--offload cpu: every offloading contender's offload_param and offload_optimizer on cpu (host RAM,
pin_memory false) instead of nvme: DeepSpeed's param_cpu; tiermem at its default budgets
(tiermem_init's 256 MiB host budget cannot hold a base's host homes).
--cgroup-limit half|SIZE (with --lora, root, cgroup v1): each contender (default tiermem_init,
deepspeed,torch) once, --steps (default 3) steps, in a fresh memory cgroup (largest_llama.
run_in_cgroup: no swap) of SIZE bytes or, with 'half', half the frozen base's fp32 bytes; per
contender whether it finished (step time, max RSS) or how it died (exit, signal, oom_kill count,
the last progress line it printed: config / built / initialized / step n), the group's peak usage
(memory.max_usage_in_bytes, page cache included) and its memory.stat sampled every 0.1 s: anonymous
memory, page cache and dirty + writeback pages at the highest usage sampled and at the last sample
(for a killed worker: how the group stood when it died).
--gradient-checkpointing (with --lora): every contender calls model.gradient_checkpointing_enable()
after the LoRA wrap, with transformers' default arguments (5.23: non-reentrant), as a LoRA user
short of memory does: each decoder layer's activations are recomputed in its backward.

--plan-check PROFILE (PROFILE: tiermem-bench profile --json's output, best measured just before; or
"each": one measured before each tiermem run by the tiermem-bench beside --plan-bin, ~40 s):
each tiermem contender's worker also writes its run as tiermem-train's --json summary gives one
(torch_bench_common.PlanSummary: the median step of steps 3.., the time split of those steps as
compute / I/O wait / communication / optimizer shares, the engine's peaks, and the model as the
engine sees it: its units' sizes, which are frozen, its FLOPs per token, whether its head is tied)
with its ds_config beside it, and tiermem-plan --check (--plan-bin, default
build/default/bin/tiermem-plan) holds it against the prediction for that configuration twice: with
PROFILE as it is, whose compute rate is tiermem-train's GPT's at the model's width, and with the
torch model's own rate instead (its forward + backward alone, no engine, measured in a fresh
process just before each run: run_rate_worker). One line each per run, and "plan_check" /
"plan_check_model_rate" per contender in --json (docs/plan.md, "Checking a tiermem.torch run").

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
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import largest_llama  # noqa: E402  (its memory cgroup: run_in_cgroup)
import torch_bench_common as common  # noqa: E402

CONTENDERS = ("deepspeed", "tiermem", "torch", "tiermem_none", "tiermem_init")
LORA_CONTENDERS = ("deepspeed", "tiermem", "torch")
CGROUP_CONTENDERS = ("tiermem_init", "deepspeed", "torch")
# DeepSpeed knobs tried by --lora (--ds-variants; "a+b" applies both): changes to zero_optimization
# over the base ds_config (offload_param buffer_count 5, buffer_size the largest tensor rounded up to
# 1 Mi elements, max_in_cpu 1e9; stage3_prefetch_bucket_size 0.9 H*H; max_live_parameters
# DeepSpeed's default 1e9).
DS_VARIANTS = {
    "base": {},
    "buffers16": {"offload_param": {"buffer_count": 16}},
    "buffers32": {"offload_param": {"buffer_count": 32}},
    "max_in_cpu0": {"offload_param": {"max_in_cpu": 0}},
    "noprefetch": {"stage3_prefetch_bucket_size": 0},
    "live1e7": {"stage3_max_live_parameters": int(1e7)},
    "param_cpu": {"offload_param": {"device": "cpu"}},  # parameters in host RAM: not the benchmark's case
}
NVME_STATS = ("nvme_read_bytes", "nvme_written_bytes") + tuple(
    f"nvme_{d}_{k}_bytes" for d in ("read", "written") for k in ("trainable", "frozen", "optimizer", "gradient"))
# engine.stats() counters a --lora run also reports step by step (each_step), beside nvme_read_bytes.
STEP_STATS = ("driving_stall_ns", "prefetch_hints", "prefetch_hints_recording")
SHAPES = common.GPT2_SHAPES


# ---------------------------------------------------------------- workers (run in their own process)

def full_llama(a):
    """The full-training Llama's shape (--llama without --lora), or None for GPT-2."""
    return lora_shape(a) if a.llama and not a.lora else None


def ds_config(a, nvme_dir, offload=True):
    """This run's ds_config (common.ds_config for GPT-2 of --model, or the Llama of --llama, with
    --batch, --sub-group-size, --ds-buffer-size); the tiermem section per contender."""
    tiermem = None
    if a.worker == "tiermem_init":
        tiermem = {"host_budget_bytes": a.init_host_budget, "device_budget_bytes": a.init_device_budget}
    elif a.worker == "tiermem_none" and a.none_host_budget:
        # tiermem's default host budget (1/16 of RAM, at most 1 GiB) refuses a resident 124 M
        # model (1.9 GiB of host homes) at offload none: the budget is raised, nothing else.
        tiermem = {"host_budget_bytes": a.none_host_budget}
    hidden, buffer_size = SHAPES[a.model]["n_embd"], a.ds_buffer_size
    llama = full_llama(a)
    if llama:  # DeepSpeed's swap buffers must hold the largest tensor (embed_tokens, lm_head)
        hidden = llama["hidden_size"]
        largest = llama["vocab_size"] * hidden
        buffer_size = max(buffer_size, (largest + (1 << 20) - 1) // (1 << 20) * (1 << 20))
    cfg = common.ds_config(hidden=hidden, batch=a.batch, nvme_dir=nvme_dir, sub_group_size=a.sub_group_size,
                           buffer_size=buffer_size, offload=offload, offload_device=a.offload, tiermem=tiermem)
    if a.worker == "deepspeed" and offload:
        cfg["zero_optimization"] = ds_variant(cfg["zero_optimization"], a.ds_variant)
    cfg["gradient_clipping"] = a.clip
    if getattr(a, "update_in_backward", False) and a.worker.startswith("tiermem"):
        cfg.setdefault("tiermem", {})["update_in_backward"] = True
    return cfg


def model_class_and_config(a, transformers):
    """This run's model class and its config: GPT-2 of --model, or the Llama of --llama."""
    llama = full_llama(a)
    if llama:
        return transformers.LlamaForCausalLM, common.llama_config(llama, a.seq)
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(**SHAPES[a.model])


def build_model(a, transformers):
    """The model of this run under whatever zero.Init the caller has opened, under
    torch.manual_seed(0) (no download)."""
    import torch
    cls, config = model_class_and_config(a, transformers)
    torch.manual_seed(0)
    return cls(config)


def run_worker(a):
    import torch
    torch.manual_seed(1)
    llama = full_llama(a)
    data = torch.randint(0, llama["vocab_size"] if llama else common.GPT2_VOCAB, (a.batch, a.seq))
    nvme_dir = tempfile.mkdtemp(prefix=f"compare_torch_{a.worker}_", dir=a.dir)
    info = {}
    marks = {}
    try:
        transformers = common.import_transformers(*(("LlamaForCausalLM",) if llama else ("GPT2LMHeadModel", "GPT2Config")))
        t_init = time.perf_counter()
        marks["imported"] = common.rss_marks()
        if a.worker == "deepspeed":
            import deepspeed
            common.init_deepspeed_gloo()
            if a.build == "init":
                model, info_keep = common.build_under_deepspeed(  # noqa: F841  (kept alive)
                    *model_class_and_config(a, transformers), ds_config(a, nvme_dir))
            else:
                model = build_model(a, transformers)
        elif a.worker in ("tiermem", "tiermem_init") and a.build == "init":
            # The model built under zero.Init: its parameters go to the NVMe staging module by
            # module, never all in host memory.
            import tiermem.torch as tt
            with tt.zero.Init(config=ds_config(a, nvme_dir)):
                model = build_model(a, transformers)
        else:
            model = build_model(a, transformers)
        marks["built"] = common.rss_marks()
        if a.worker == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(a, nvme_dir))
            info["deepspeed"] = deepspeed.__version__
            info["ds_variant"] = a.ds_variant

            def step():
                return common.engine_step(engine, data)
        elif a.worker in ("tiermem", "tiermem_none", "tiermem_init"):
            import tiermem.torch as tt
            cfg = ds_config(a, nvme_dir, offload=a.worker != "tiermem_none")
            engine, *_ = tt.initialize(model=model, config=cfg)

            def step():
                return common.engine_step(engine, data)
            if a.plan_summary:  # --plan-check: the same step, its time split kept for tiermem-plan --check
                plan = common.PlanSummary(engine, model, cfg, data, plan_model_name(a))
                step = plan.step
        elif a.worker == "torch":
            step = common.plain_step(model, data, a.clip)
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
            if a.plan_summary:
                plan.write(a.plan_summary)
            engine.close()
        print(json.dumps(out))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def llama_flags(a):
    """A worker's command-line flags for the Llama shape a run asked for (none for GPT-2)."""
    if not a.llama:
        return []
    flags = ["--llama", a.llama]
    for flag, v in (("--llama-layers", a.llama_layers), ("--llama-hidden", a.llama_hidden),
                    ("--llama-intermediate", a.llama_intermediate)):
        if v:
            flags += [flag, str(v)]
    return flags


def run_rate_worker(a):
    """--plan-check: the run's model alone (no engine, no optimizer; the LoRA-wrapped Llama with
    --lora), its forward + backward rate in model FLOP/s (common.model_rate) printed as JSON."""
    import torch
    torch.manual_seed(1)
    if a.lora:
        transformers = common.import_transformers("LlamaForCausalLM")
        shape = lora_shape(a)
        data = torch.randint(0, shape["vocab_size"], (a.batch, a.seq))
        torch.manual_seed(0)
        model = common.lora_wrap(transformers.LlamaForCausalLM(common.llama_config(shape, a.seq)))
    else:
        llama = full_llama(a)
        transformers = common.import_transformers(*(("LlamaForCausalLM",) if llama else ("GPT2LMHeadModel", "GPT2Config")))
        data = torch.randint(0, llama["vocab_size"] if llama else common.GPT2_VOCAB, (a.batch, a.seq))
        model = build_model(a, transformers)
    model.train()
    gflops, seconds = common.model_rate(model, data)
    print(json.dumps({"gflops": gflops, "seconds": seconds}))


def plan_profile(a, summary):
    """--plan-check: the machine profile a run is checked against: PROFILE as given, or with
    `--plan-check each` one tiermem-bench profile (beside --plan-bin) measured just before the run,
    written beside its summary (the load of a shared machine moves the rates within minutes)."""
    if a.plan_check != "each":
        return a.plan_check
    path = summary + ".profile.json"
    bench = os.path.join(os.path.dirname(os.path.abspath(a.plan_bin)), "tiermem-bench")
    swap = os.path.join(a.dir, f"compare_torch_profile_{os.getpid()}")
    with open(path, "w") as f:
        r = subprocess.run([bench, "profile", "--path", swap, "--json"], stdout=f, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(a.threads), OMP_WAIT_POLICY="PASSIVE"),
                           timeout=a.timeout)
    shutil.rmtree(swap, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"--plan-check each: {bench} profile failed: {r.stderr.strip()[-300:]}")
    return path


def plan_rate(a, summary, profile):
    """--plan-check, before each tiermem run: the model's own compute rate, measured in a fresh process
    (run_rate_worker) just before the run (the load of a shared machine moves it within minutes), and
    a.plan_check's profile with that rate, written beside the run's summary: its path, or None when
    the measurement failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "torch_rate", "--model", a.model, "--seq", str(a.seq),
           "--batch", str(a.batch)]
    if a.lora:
        cmd.append("--lora")
    cmd += llama_flags(a)
    r = subprocess.run(cmd, capture_output=True, text=True, env=common.worker_env(a.threads), timeout=a.timeout)
    if r.returncode != 0:
        print(f"--plan-check: the model's own rate was not measured: {(r.stderr or r.stdout).strip()[-300:]}", flush=True)
        return None
    rate = json.loads(r.stdout.strip().splitlines()[-1])
    path = summary + ".model-rate-profile.json"
    common.rate_profile(profile, path, rate["gflops"],
                        f"the torch model's own forward + backward, {rate['gflops']:.1f} GFLOP/s "
                        f"({rate['seconds']:.3f} s a step, measured just before the run; compare_torch.py --plan-check)")
    return path


def plan_model_name(a):
    """The model's name in a --plan-check summary."""
    if a.lora:
        return f"hf-llama-{a.llama}-lora"
    return f"hf-llama-{a.llama}" if a.llama else f"hf-gpt2-{a.model}"


# ---------------------------------------------------------------- the LoRA workload (--lora)

def lora_shape(a):
    return common.llama_shape(a.llama, a.llama_layers, a.llama_hidden, a.llama_intermediate)


def ds_variant(zero, name):
    """zero_optimization with the knobs of DS_VARIANTS[n] for each n of name.split('+')."""
    zero = json.loads(json.dumps(zero))
    for n in name.split("+"):
        for k, v in DS_VARIANTS[n].items():
            if isinstance(v, dict):
                zero.setdefault(k, {}).update(v)
            else:
                zero[k] = v
    if zero.get("offload_param", {}).get("device") == "cpu":
        zero["offload_param"].pop("nvme_path", None)
    return zero


def lora_ds_config(a, nvme_dir):
    """common.ds_config for the Llama of lora_shape(a): buffer_size the largest tensor (embed_tokens,
    lm_head) rounded up to 1 Mi elements, as largest_llama.py; DeepSpeed's knobs of --ds-variant;
    tiermem_init's budgets in the tiermem section."""
    shape = lora_shape(a)
    largest = shape["vocab_size"] * shape["hidden_size"]
    tiermem = None
    if a.worker == "tiermem_init":
        tiermem = {"host_budget_bytes": a.init_host_budget, "device_budget_bytes": a.init_device_budget}
    if a.frozen_dtype and a.worker.startswith("tiermem"):
        tiermem = dict(tiermem or {}, frozen_dtype=a.frozen_dtype)
    cfg = common.ds_config(hidden=shape["hidden_size"], batch=a.batch, nvme_dir=nvme_dir,
                           sub_group_size=a.sub_group_size,
                           buffer_size=(largest + (1 << 20) - 1) // (1 << 20) * (1 << 20),
                           offload_device=a.offload, tiermem=tiermem)
    if a.worker == "deepspeed":
        cfg["zero_optimization"] = ds_variant(cfg["zero_optimization"], a.ds_variant)
    return cfg


def progress(stage, **kw):
    """A progress line (what a worker killed in the cgroup had reached)."""
    print(json.dumps({"progress": stage, "max_rss_bytes": common.max_rss_bytes(), **kw}), flush=True)


def run_lora_worker(a):
    import torch
    transformers = common.import_transformers("LlamaForCausalLM")  # before any zero.Init
    import peft  # noqa: F401  (likewise)
    shape = lora_shape(a)
    torch.manual_seed(1)
    data = torch.randint(0, shape["vocab_size"], (a.batch, a.seq))
    nvme_dir = tempfile.mkdtemp(prefix=f"compare_torch_lora_{a.worker}_", dir=a.dir)
    out = {"contender": a.worker}
    marks = {"imported": common.rss_marks()}
    try:
        t_init = time.perf_counter()
        io0 = common.proc_io()
        cfg = lora_ds_config(a, nvme_dir)
        if a.worker == "deepspeed":
            import deepspeed
            out["deepspeed"] = deepspeed.__version__
            out["ds_variant"] = a.ds_variant
            out["ds_zero_config"] = {k: v for k, v in cfg["zero_optimization"].items()}
            progress("config", ds_variant=a.ds_variant, ds_zero_config=out["ds_zero_config"])
            common.init_deepspeed_gloo()
            base, keep = common.build_under_deepspeed(  # noqa: F841  (kept alive)
                transformers.LlamaForCausalLM, common.llama_config(shape, a.seq), cfg)
        elif a.worker in ("tiermem", "tiermem_init"):
            import tiermem.torch as tt
            torch.manual_seed(0)
            with tt.zero.Init(config=cfg):
                base = transformers.LlamaForCausalLM(common.llama_config(shape, a.seq))
        elif a.worker == "torch":
            torch.manual_seed(0)
            base = transformers.LlamaForCausalLM(common.llama_config(shape, a.seq))
        else:
            raise SystemExit(f"contender {a.worker} has no LoRA run (deepspeed, tiermem, tiermem_init, torch)")
        model = common.lora_wrap(base)
        if a.gradient_checkpointing:  # transformers' default (5.23: non-reentrant), as a LoRA user turns it on
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # 5.23: a deprecated alias, still the documented call
                model.gradient_checkpointing_enable()
            out["gradient_checkpointing"] = True
        numel = [(getattr(q, "ds_numel", None) or q.numel(), q.requires_grad) for q in model.parameters()]
        out["trainable_params"] = sum(n for n, t in numel if t)
        out["frozen_params"] = sum(n for n, t in numel if not t)
        marks["built"] = common.rss_marks()
        progress("built", t=time.perf_counter() - t_init)
        if a.worker == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                              model_parameters=[q for q in model.parameters() if q.requires_grad])

            def step():
                return common.engine_step(engine, data)
        elif a.worker.startswith("tiermem"):
            engine, *_ = tt.initialize(model=model, config=cfg)

            def step():
                return common.engine_step(engine, data)
            if a.plan_summary:  # --plan-check: the same step, its time split kept for tiermem-plan --check
                plan = common.PlanSummary(engine, model, cfg, data, plan_model_name(a))
                step = plan.step
        else:
            step = common.plain_step(model, data, a.clip)
        out["init_s"] = time.perf_counter() - t_init
        marks["initialized"] = common.rss_marks()
        progress("initialized", t=out["init_s"])

        def counters():
            c = dict(zip(("proc_read_bytes", "proc_write_bytes"), common.proc_io()))
            if a.worker.startswith("tiermem"):
                st = engine.stats()
                c.update({k: st[k] for k in NVME_STATS + STEP_STATS if k in st})
            return c

        snaps = [counters()]
        out["init_io"] = {k: snaps[0][k] - v for k, v in
                          zip(("proc_read_bytes", "proc_write_bytes"), io0)}

        def after(i, seconds, loss):
            snaps.append(counters())
            if i == 0:
                marks["step1"] = common.rss_marks()
            progress("step", step=i + 1, step_s=seconds, loss=loss)

        times, losses = common.timed_steps(step, a.steps, after=after)
        first = 2 if len(times) > 2 else 0  # the measured steps: 3.. (all when there are 2 or fewer)
        per_step = {k: (snaps[-1][k] - snaps[first][k]) / (len(times) - first) for k in snaps[0]}
        # Each step's own figures (tiermem: its NVMe reads, the calling thread's waits, the
        # Prefetcher's hints given while the step recorded its order by the previous one's).
        each = [{"step_s": t, **{k: snaps[i + 1][k] - snaps[i][k] for k in snaps[0] if k in ("nvme_read_bytes",) + STEP_STATS}}
                for i, t in enumerate(times)]
        out.update(step_s=statistics.median(times[first:]), step_times=times, losses=losses,
                   max_rss_bytes=common.max_rss_bytes(), threads=torch.get_num_threads(), rss_marks=marks,
                   io_per_step=per_step, measured_steps=[first + 1, len(times)], each_step=each)
        if a.worker.startswith("tiermem"):
            out["stats"] = common.scalar_stats(engine)
            if a.plan_summary:
                plan.write(a.plan_summary)
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
    extra = []
    if who.endswith("+ub"):  # tiermem.update_in_backward on (applies with --clip 0)
        who, extra = who[:-3], ["--update-in-backward"]
    if who.startswith("tiermem_init@"):  # tiermem_init at other budgets: host and device SIZE each
        size = who.split("@", 1)[1]
        a = argparse.Namespace(**{**vars(a), "init_host_budget": size, "init_device_budget": size})
        who = "tiermem_init"
    env = common.worker_env(a.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", who, "--model", a.model, "--seq", str(a.seq),
           "--batch", str(a.batch), "--steps", str(a.steps), "--dir", a.dir, "--ds-buffer-size",
           str(a.ds_buffer_size), "--sub-group-size", str(a.sub_group_size), "--none-host-budget", a.none_host_budget,
           "--init-host-budget", a.init_host_budget, "--init-device-budget", a.init_device_budget, "--build", a.build,
           "--ds-variant", a.ds_variant, "--clip", str(a.clip), "--offload", a.offload] + extra
    cmd += llama_flags(a)
    if profile:
        cmd.append("--profile")
    summary = plan_summary_path(a, who)
    profile = model_profile = None
    if summary:
        cmd += ["--plan-summary", summary]
        profile = plan_profile(a, summary)
        model_profile = plan_rate(a, summary, profile)
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
    add_plan_check(a, res, summary, profile, model_profile)
    return res


def plan_summary_path(a, who):
    """--plan-check: where a tiermem contender's worker writes its PlanSummary (None: no check)."""
    if not a.plan_check or not who.startswith("tiermem"):
        return None
    a.plan_runs = getattr(a, "plan_runs", 0) + 1
    return os.path.join(a.plan_dir, f"{who.replace(':', '_').replace('@', '_')}-{a.plan_runs}.json")


def add_plan_check(a, res, summary, profile, model_profile):
    """--plan-check: tiermem-plan --check of the run's summary against the profile (res["plan_check"])
    and against it with the model's own rate (res["plan_check_model_rate"])."""
    if summary and "error" not in res:
        res["plan_check"] = common.plan_check(a.plan_bin, summary, profile)
        res["plan_check"]["summary"] = summary
        if model_profile:
            res["plan_check_model_rate"] = common.plan_check(a.plan_bin, summary, model_profile)


# ---------------------------------------------------------------- the LoRA driver

def spawn_lora(a, who, variant="base", limit=None):
    """One LoRA worker in a fresh process (in a memory cgroup of `limit` bytes when given): its
    result, or {"error": ...}; in the cgroup also how it ended (exit, OOM kills, the group's usage)
    and the last progress line it printed."""
    env = common.worker_env(a.threads)
    who, _, at_rest = who.partition(":")  # tiermem...:DTYPE: the frozen base at rest in DTYPE
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", who, "--lora",
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--dir", a.dir,
           "--sub-group-size", str(a.sub_group_size), "--init-host-budget", a.init_host_budget,
           "--init-device-budget", a.init_device_budget, "--ds-variant", variant, "--offload", a.offload]
    cmd += llama_flags(a)  # --lora always has --llama
    if at_rest:
        cmd += ["--frozen-dtype", at_rest]
    if a.gradient_checkpointing:
        cmd += ["--gradient-checkpointing"]
    summary = None if limit else plan_summary_path(a, who + (f"_{at_rest}" if at_rest else ""))
    profile = model_profile = None
    if summary:
        cmd += ["--plan-summary", summary]
        profile = plan_profile(a, summary)
        model_profile = plan_rate(a, summary, profile)
    t0 = time.perf_counter()
    if limit:
        r = largest_llama.run_in_cgroup(cmd, env, limit, a.timeout, f"compare_torch_{os.getpid()}_{who}")
        rc, stdout, stderr = r.pop("rc"), r.pop("stdout"), r.pop("stderr")
        cg = r
    else:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = None, e.stdout or "", f"timed out after {a.timeout} s"
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        cg = None
    wall = time.perf_counter() - t0
    lines = []
    for ln in stdout.splitlines():
        if ln.startswith("{"):
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    final = next((x for x in reversed(lines) if "progress" not in x), None)
    prog = [x for x in lines if "progress" in x]
    res = dict(final) if (rc == 0 and final is not None) else {}
    if rc != 0 or final is None:
        tail = [ln for ln in (stderr or "").strip().splitlines() if not ln.startswith("[transformers]")][-15:]
        exit_ = rc if rc is None or rc >= 0 else f"signal {-rc}"
        err = next((ln for ln in reversed(tail) if "Error" in ln or "assert" in ln.lower()), tail[-1] if tail else "")
        res = {"error": f"exit {cg['exit'] if cg else exit_}: {err}", "stderr_tail": tail[-6:],
               "ds_zero_config": next((x["ds_zero_config"] for x in prog if "ds_zero_config" in x), None)}
    res["wall_s"] = wall
    res["ds_variant"] = variant if who == "deepspeed" else None
    if prog:
        res["last_progress"] = prog[-1]
        res["steps_done"] = sum(1 for x in prog if x["progress"] == "step")
        if "max_rss_bytes" not in res:
            res["max_rss_bytes_at_last_progress"] = prog[-1]["max_rss_bytes"]
    if cg is not None:
        res["cgroup"] = cg
    add_plan_check(a, res, summary, profile, model_profile)
    return res


def ds_attempt(a, ds, limit):
    """DeepSpeed's LoRA run: the variant that ran before, or --ds-variants in order until one
    finishes (all of them with --ds-try-all); every attempt recorded in ds["attempts"]."""
    if ds["variant"]:
        return spawn_lora(a, "deepspeed", ds["variant"], limit)
    if ds["attempts"]:
        return {"error": "no DeepSpeed variant ran (see ds_attempts)"}
    good = first_fail = None
    for v in [x.strip() for x in a.ds_variants.split(",") if x.strip()]:
        r = spawn_lora(a, "deepspeed", v, limit)
        ok = "error" not in r
        ds["attempts"].append({"variant": v, "knobs": [DS_VARIANTS[n] for n in v.split("+")], "ran": ok,
                               "error": r.get("error"), "stderr_tail": r.get("stderr_tail"),
                               "steps_done": r.get("steps_done", 0), "max_rss_bytes": r.get("max_rss_bytes"),
                               "step_s": r.get("step_s"),
                               "last_progress": (r.get("last_progress") or {}).get("progress"),
                               "ds_zero_config": r.get("ds_zero_config"), "cgroup": r.get("cgroup")})
        print(f"  deepspeed variant {v:24s} {'ran' if ok else 'FAILED ' + r['error'][:300]}", flush=True)
        if not ok and first_fail is None:
            first_fail = r
        if ok and good is None:
            good = r
            ds["variant"] = v
            if not a.ds_try_all:
                break
    if good:
        return good
    return dict(first_fail, error="no DeepSpeed variant ran: " + "; ".join(
        f"{x['variant']}: {(x['error'] or '')[:160]}" for x in ds["attempts"]))


def gib(x):
    return f"{x / 2**30:.2f}" if x is not None else "—"


def mb(x):
    return f"{x / 1e6:.1f}" if x is not None else "—"


def at_rest_report(results):
    """Each tiermem...:DTYPE contender against the same contender without the suffix (same run,
    interleaved): the largest loss difference over the steps (absolute and relative), step time and
    max RSS ratios, and the NVMe bytes read per step; printed and returned."""
    out = {}
    for c, r in results.items():
        base = results.get(c.partition(":")[0])
        if ":" not in c or r.get("error") or not base or base.get("error"):
            continue
        d = [abs(x - y) for x, y in zip(r["losses"], base["losses"])]
        rel = [abs(x - y) / abs(y) for x, y in zip(r["losses"], base["losses"])]
        read = r["io_per_step"].get("nvme_read_bytes")
        base_read = base["io_per_step"].get("nvme_read_bytes")
        out[c] = {"max_abs_loss_diff": max(d), "max_rel_loss_diff": max(rel),
                  "step_s_ratio": r["step_s"] / base["step_s"],
                  "max_rss_ratio": r["max_rss_bytes"] / base["max_rss_bytes"],
                  "nvme_read_per_step": read, "base_nvme_read_per_step": base_read,
                  "frozen_param_bytes": (r.get("stats") or {}).get("frozen_param_bytes"),
                  "base_frozen_param_bytes": (base.get("stats") or {}).get("frozen_param_bytes")}
        o = out[c]
        print(f"{c} vs {c.partition(':')[0]}: loss max |diff| {o['max_abs_loss_diff']:.2e} "
              f"({o['max_rel_loss_diff']:.2e} relative) over {len(d)} steps; step {o['step_s_ratio']:.2f}x, "
              f"max RSS {o['max_rss_ratio']:.2f}x; NVMe read per step {mb(read)} MB vs {mb(base_read)} MB; "
              f"frozen base at rest {mb(o['frozen_param_bytes'])} MB vs {mb(o['base_frozen_param_bytes'])} MB")
    return out


def cgroup_split(sample):
    """'anon / cache / dirty+writeback' (GiB) of a largest_llama.GroupSampler sample, '—' without one."""
    if not sample:
        return "—"
    return (f"{gib(sample.get('rss'))} / {gib(sample.get('cache'))} / "
            f"{gib(sample.get('dirty', 0) + sample.get('writeback', 0))}")


def lora_main(a):
    shape = lora_shape(a)
    n_base = common.llama_param_count(shape)
    base_fp32 = 4 * n_base
    limit = None
    if a.cgroup_limit:
        if not largest_llama.cgroup_available():
            raise SystemExit(f"compare_torch: {largest_llama.CGROUP_ROOT} is not writable (needs root and the "
                             "cgroup v1 memory controller)")
        limit = base_fp32 // 2 if a.cgroup_limit == "half" else largest_llama.parse_bytes(a.cgroup_limit)
    cpu, avx512 = common.cpu_name()
    print(f"CPU: {cpu} ({'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} logical CPUs; "
          f"OMP_NUM_THREADS={a.threads} OMP_WAIT_POLICY=PASSIVE for every contender", flush=True)
    print(f"LoRA: LlamaForCausalLM {a.llama} {shape} ({n_base:,} base parameters, frozen base "
          f"{base_fp32 / 2**30:.2f} GiB fp32), peft LoraConfig {common.LORA}, batch {a.batch} x seq {a.seq}, fp32, "
          f"{a.steps} steps, params and optimizer on {a.offload}" + (f" under {a.dir}" if a.offload == "nvme" else "")
          + (", gradient checkpointing (transformers' default)" if a.gradient_checkpointing else ""),
          flush=True)
    if limit:
        rule = "" if limit * 2 <= base_fp32 else " (ABOVE half the frozen base's fp32 bytes: not the issue's case)"
        print(f"memory cgroup: limit {limit / 2**30:.3f} GiB = {limit / base_fp32:.3f} x the frozen base's "
              f"fp32 bytes{rule}; swap not given", flush=True)
    default = CGROUP_CONTENDERS if limit else LORA_CONTENDERS
    who = [c.strip() for c in (a.contenders or ",".join(default)).split(",") if c.strip()]
    runs = {c: [] for c in who}
    ds = {"variant": None, "attempts": []}
    loads = []
    rounds = 1 if limit else a.rounds
    for rnd in range(rounds):
        order = who[rnd % len(who):] + who[:rnd % len(who)]
        for c in order:
            la = common.loadavg()
            loads.append(la)
            r = ds_attempt(a, ds, limit) if c == "deepspeed" else spawn_lora(a, c, limit=limit)
            r["loadavg_before"] = la
            runs[c].append(r)
            if "error" in r:
                print(f"round {rnd + 1} {c:13s} FAILED {r['error'][:400]}", flush=True)
            else:
                io = r["io_per_step"]
                print(f"round {rnd + 1} {c:13s} step {r['step_s']:7.3f} s  max RSS {gib(r['max_rss_bytes'])} GiB"
                      f"  init {r['init_s']:5.1f} s  load {la:.2f}  io/step read {mb(io['proc_read_bytes'])} MB "
                      f"written {mb(io['proc_write_bytes'])} MB  losses {r['losses'][0]:.4f}..{r['losses'][-1]:.4f}",
                      flush=True)
                if "nvme_read_bytes" in r["each_step"][0]:
                    print("    by step: " + "; ".join(
                        f"{i + 1}: {e['step_s']:.2f} s, read {e['nvme_read_bytes'] / 1e9:.2f} GB, waited "
                        f"{e['driving_stall_ns'] / 1e9:.2f} s" + (f", {e['prefetch_hints_recording']} hints while "
                                                                  "recording" if e['prefetch_hints_recording'] else "")
                        for i, e in enumerate(r["each_step"])), flush=True)
                if "plan_check" in r:
                    print(common.plan_check_line(c, r["plan_check"]), flush=True)
                if "plan_check_model_rate" in r:
                    print(common.plan_check_line(c, r["plan_check_model_rate"], "the model's rate"), flush=True)
    results = {}
    for c, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            results[c] = {k: rs[0].get(k) for k in ("error", "stderr_tail", "steps_done", "last_progress",
                                                    "max_rss_bytes_at_last_progress", "cgroup", "ds_variant")}
            continue
        r0 = ok[0]
        results[c] = {"step_s": statistics.median(r["step_s"] for r in ok),
                      "max_rss_bytes": statistics.median(r["max_rss_bytes"] for r in ok),
                      "init_s": statistics.median(r["init_s"] for r in ok),
                      "rounds": len(ok), "step_s_each": [r["step_s"] for r in ok], "losses": r0["losses"],
                      "each_step_each": [r["each_step"] for r in ok],
                      "io_per_step": r0["io_per_step"], "init_io": r0["init_io"],
                      "measured_steps": r0["measured_steps"], "trainable_params": r0["trainable_params"],
                      "frozen_params": r0["frozen_params"], "rss_marks": r0["rss_marks"],
                      "ds_variant": r0.get("ds_variant"), "ds_zero_config": r0.get("ds_zero_config"),
                      "stats": r0.get("stats"), "cgroup": r0.get("cgroup")}
        if any("plan_check" in r for r in ok):
            results[c]["plan_check"] = [r.get("plan_check") for r in ok]
            results[c]["plan_check_model_rate"] = [r.get("plan_check_model_rate") for r in ok]

    def ratio(num, den, key, invert=False):
        x, y = results.get(num, {}), results.get(den, {})
        if x.get(key) is None or y.get(key) is None:
            return None
        return y[key] / x[key] if invert else x[key] / y[key]

    ratios = {f"{t}_vs_{o}_{k}": ratio(t, o, key, invert=(k == "speed"))
              for t in ("tiermem", "tiermem_init") for o in ("deepspeed", "torch")
              for k, key in (("speed", "step_s"), ("rss", "max_rss_bytes"))}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    print()
    if limit:
        print(f"memory cgroup {limit / 2**30:.3f} GiB ({limit / base_fp32:.3f} x frozen base fp32), {a.steps} steps:")
        print("| contender | outcome | step (s) | max RSS (GiB) | cgroup peak (GiB) | anon / page cache / "
              "dirty+writeback (GiB): at the peak sampled; at the last sample | steps done | losses |")
        print("|---|---|---|---|---|---|---|---|")
        for c, r in results.items():
            cg = r.get("cgroup") or {}
            split = f"{cgroup_split(cg.get('cgroup_at_peak'))}; {cgroup_split(cg.get('cgroup_last'))}"
            if "error" in r and r["error"]:
                lp = (r.get("last_progress") or {}).get("progress", "nothing")
                how = (f"killed by the OOM killer (oom_kill {cg.get('oom_kills')})"
                       if cg.get("oom_kills") else r["error"][:160])
                at = r.get("max_rss_bytes_at_last_progress")
                if c == "deepspeed" and ds["attempts"]:
                    how = f"{ds['attempts'][0]['variant']}: {how} (every variant: see DeepSpeed attempts)"
                print(f"| {c} | {how}; last reached: {lp} | — | {gib(at) + ' at it' if at else '—'}"
                      f" | {gib(cg.get('cgroup_max_usage_bytes'))} | {split} | {r.get('steps_done') or 0} | |")
            else:
                print(f"| {c} | finished, exit 0 | {r['step_s']:.2f} | {gib(r['max_rss_bytes'])} | "
                      f"{gib(cg.get('cgroup_max_usage_bytes'))} | {split} | {len(r['losses'])} | "
                      f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    else:
        print("| contender | step (s, median) | max RSS (GiB) | init (s) | NVMe read / written per step (MB, "
              "/proc/self/io) | tiermem NVMe read per step: frozen / trainable / optimizer / gradient (MB) | written: "
              "frozen / trainable / optimizer / gradient (MB) | losses |")
        print("|---|---|---|---|---|---|---|---|")
        for c, r in results.items():
            if r.get("error"):
                print(f"| {c} | failed: {r['error'][:160]} | | | | | | |")
                continue
            io = r["io_per_step"]
            split = ["—", "—"]
            if "nvme_read_frozen_bytes" in io:
                kinds = ("frozen", "trainable", "optimizer", "gradient")
                split = [" / ".join(mb(io.get(f"nvme_{d}_{k}_bytes")) for k in kinds) for d in ("read", "written")]
            name = c + (f" ({r['ds_variant']})" if r.get("ds_variant") else "")
            print(f"| {name} | {r['step_s']:.3f} | {gib(r['max_rss_bytes'])} | {r['init_s']:.1f} | "
                  f"{mb(io['proc_read_bytes'])} / {mb(io['proc_write_bytes'])} | {split[0]} | {split[1]} | "
                  f"{r['losses'][0]:.4f}..{r['losses'][-1]:.4f} |")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    at_rest = at_rest_report(results)
    if ds["attempts"]:
        print("DeepSpeed attempts: " + "; ".join(
            f"{x['variant']}: {'ran' if x['ran'] else (x['error'] or '')[:200]}" for x in ds["attempts"]))
    print(f"load average (1 min) before runs: min {min(loads):.2f} median {statistics.median(loads):.2f} "
          f"max {max(loads):.2f}")
    if a.json:
        print(json.dumps({"workload": "lora", "llama": a.llama, "shape": shape, "base_params": n_base,
                          "frozen_base_fp32_bytes": base_fp32, "lora": common.LORA, "cgroup_limit_bytes": limit,
                          "results": results, "ratios": ratios, "at_rest_vs_base": at_rest, "ds_attempts": ds["attempts"], "loadavg": loads,
                          "cpu": cpu, "avx512": avx512, "threads": a.threads, "seq": a.seq, "batch": a.batch,
                          "steps": a.steps, "rounds": rounds, "gradient_checkpointing": a.gradient_checkpointing}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offload", choices=("nvme", "cpu"), default="nvme",
                   help="where the offloading contenders' offload_param and offload_optimizer go (default nvme; "
                        "cpu: host RAM, pin_memory false; give tiermem_init budgets that hold the model's homes)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default="/tmp", help="where each run's nvme directory is made (default /tmp)")
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 10; 3 with --cgroup-limit)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contenders", default=None,
                   help=f"default {','.join(CONTENDERS)}; with --lora {','.join(LORA_CONTENDERS)}; "
                        f"with --cgroup-limit {','.join(CGROUP_CONTENDERS)}")
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
    p.add_argument("--lora", action="store_true",
                   help="the LoRA workload: a Llama under each contender's zero.Init, peft LoRA r 8 on q/v_proj")
    p.add_argument("--llama", choices=sorted(common.LLAMA_SHAPES), default=None,
                   help="a Llama of this shape instead of GPT-2 (tiny: 2 layers, hidden 256; 1b: TinyLlama-1.1B's), "
                        "fully trained; with --lora its frozen base (default tiny)")
    p.add_argument("--llama-layers", type=int, default=None, help="override the preset's num_hidden_layers")
    p.add_argument("--llama-hidden", type=int, default=None, help="override the preset's hidden_size")
    p.add_argument("--llama-intermediate", type=int, default=None, help="override the preset's intermediate_size")
    p.add_argument("--ds-variants", default="base,buffers16,noprefetch,max_in_cpu0,buffers32+noprefetch,param_cpu",
                   help=f"--lora: DeepSpeed's configurations tried in order until one runs ({', '.join(DS_VARIANTS)}; "
                        "'a+b' both)")
    p.add_argument("--ds-try-all", action="store_true", help="--lora: try every --ds-variants entry, not up to "
                   "the first that runs")
    p.add_argument("--cgroup-limit", default=None,
                   help="--lora: run each contender once, --steps (default 3) steps, in a memory cgroup of this "
                        "size ('half': half the frozen base's fp32 bytes; or e.g. 1.5GiB); needs root")
    p.add_argument("--ds-variant", default="base",
                   help=f"without --lora: DeepSpeed's configuration ({', '.join(DS_VARIANTS)}; 'a+b' both; default base)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping of every contender (0: none)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="--lora: every contender's model.gradient_checkpointing_enable() (transformers' default "
                        "kwargs) after the LoRA wrap: each decoder layer's activations recomputed in backward")
    p.add_argument("--frozen-dtype", choices=("bf16", "int8"), default=None,
                   help="--lora worker: tiermem.frozen_dtype (give it as a contender suffix, tiermem_init:int8)")
    p.add_argument("--plan-check", metavar="PROFILE", default=None,
                   help="hold each tiermem contender's run against tiermem-plan's prediction for its configuration, "
                        "with PROFILE (tiermem-bench profile --json's output; 'each': one measured before each run): "
                        "step time, shares, peaks")
    p.add_argument("--plan-bin", default=os.path.join(os.path.dirname(HERE), "build", "default", "bin", "tiermem-plan"),
                   help="--plan-check: the tiermem-plan executable (default build/default/bin/tiermem-plan)")
    p.add_argument("--plan-summary", help=argparse.SUPPRESS)  # worker: write its PlanSummary here
    p.add_argument("--update-in-backward", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps is None:
        a.steps = 3 if a.cgroup_limit else 10
    if a.cgroup_limit and not a.lora:
        p.error("--cgroup-limit needs --lora")
    a.ds_buffer_size = int(float(a.ds_buffer_size))
    a.sub_group_size = int(float(a.sub_group_size))
    if a.lora and not a.llama:
        a.llama = "tiny"
    if a.worker == "torch_rate":
        return run_rate_worker(a)
    if a.worker:
        return run_lora_worker(a) if a.lora else run_worker(a)
    if a.plan_check:
        if a.profile or a.cgroup_limit:
            p.error("--plan-check runs with neither --profile nor --cgroup-limit")
        a.plan_dir = tempfile.mkdtemp(prefix="compare_torch_plan_")
        print(f"--plan-check: the tiermem contenders' summaries and ds_configs in {a.plan_dir}", flush=True)
    if a.lora:
        return lora_main(a)
    a.contenders = a.contenders or ",".join(CONTENDERS)

    cpu, avx512 = common.cpu_name()
    print(f"CPU: {cpu} ({'AVX-512' if avx512 else 'no AVX-512'}), {os.cpu_count()} logical CPUs; "
          f"OMP_NUM_THREADS={a.threads} OMP_WAIT_POLICY=PASSIVE for every contender; "
          f"{f'Llama {a.llama} ' + str(full_llama(a)) if a.llama else f'GPT-2 {a.model}'}, batch {a.batch} x seq {a.seq}, "
          f"fp32; nvme dir under {a.dir}", flush=True)
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
                if "plan_check" in r:
                    print(common.plan_check_line(c, r["plan_check"]), flush=True)
                if "plan_check_model_rate" in r:
                    print(common.plan_check_line(c, r["plan_check_model_rate"], "the model's rate"), flush=True)
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
        if any("plan_check" in r for r in ok):
            results[c]["plan_check"] = [r.get("plan_check") for r in ok]
            results[c]["plan_check_model_rate"] = [r.get("plan_check_model_rate") for r in ok]
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
    for c in results:
        if c.startswith("tiermem_init@"):
            ratios[f"{c}_vs_deepspeed_speed"] = ratio(c, "deepspeed", "step_s", invert=True)
            ratios[f"{c}_vs_deepspeed_rss"] = ratio(c, "deepspeed", "max_rss_bytes")
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
                          "threads": a.threads, "model": f"llama-{a.llama}" if a.llama else a.model,
                          "seq": a.seq, "batch": a.batch,
                          "steps": a.steps, "rounds": a.rounds}))


if __name__ == "__main__":
    main()
