"""bench/torch_bench_common.py — what the torch-face benches share: the model set-up, the ds_config
both offloading contenders train with, DeepSpeed's one-process group on the CPU, the timed step
loop, the memory readings, the worker environment and the machine's description. Imported by
bench/compare_torch.py, compare_torch_ranks.py and largest_llama.py (each puts bench/ on
sys.path); not a program.

torch, transformers and deepspeed are imported inside the functions that need them, never at the
top: the drivers read --help, spawn workers and print tables without them (only the workers train).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

# GPT-2's shapes (transformers.GPT2Config's defaults for small; GPT-2 medium's), vocab 50257.
GPT2_SHAPES = {"small": dict(n_layer=12, n_embd=768, n_head=12), "medium": dict(n_layer=24, n_embd=1024, n_head=16)}
GPT2_VOCAB = 50257

# Llama shapes (LlamaConfig keywords; the head is untied). tiny: a functional check in seconds;
# 1b: TinyLlama-1.1B's shape (1,100,048,384 parameters), largest_llama.py's default.
LLAMA_SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=32000),
    "1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
}
# Llama-2-7B's shape (llama7b_demo.py, generate_passes.py; not a compare_torch.py preset).
LLAMA_7B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
# The LoRA of compare_torch.py --lora: peft.LoraConfig's keywords.
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


# ---------------------------------------------------------------- models

def import_transformers(*classes):
    """transformers, quiet, with `classes` (names) imported now: a model's classes must be imported
    before any zero.Init, as a script's imports at its top are (DeepSpeed 0.19.8's Init fails when
    transformers imports a model's file inside it, on torch 2.15)."""
    import transformers
    transformers.logging.set_verbosity_error()
    for c in classes:
        getattr(transformers, c)
    return transformers


def build_gpt2(shape):
    """transformers.GPT2LMHeadModel of GPT2_SHAPES[shape], built under torch.manual_seed(0) (no
    download), under whatever zero.Init the caller has opened."""
    import torch
    transformers = import_transformers()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SHAPES[shape]))


def build_under_deepspeed(model_class, model_config, ds_cfg):
    """As DeepSpeed's HF users build a model: HfDeepSpeedConfig(ds_cfg), kept alive, makes
    _from_config build under deepspeed.zero.Init (each parameter partitioned to the config's
    offload_param as its module is built) and initialise the weights gathered; under
    torch.manual_seed(0). Returns (model, keep): hold `keep` as long as the model is used."""
    import torch
    from transformers.integrations import HfDeepSpeedConfig
    keep = HfDeepSpeedConfig(ds_cfg)
    torch.manual_seed(0)
    return model_class._from_config(model_config), keep


def llama_shape(preset, layers=None, hidden=None, intermediate=None):
    """LLAMA_SHAPES[preset] with the given fields replaced (None: the preset's)."""
    shape = dict(LLAMA_SHAPES[preset])
    for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden), ("intermediate_size", intermediate)):
        if v:
            shape[k] = v
    return shape


def llama_7b_scaled(hidden=4096, layers=32, vocab=32000):
    """LLAMA_7B at `hidden` (its MLP 11008 / 4096 of it, heads of 128), `layers` and `vocab` rows:
    the shape generate_passes.py builds and engine_passes.py lists (LLAMA_7B at the defaults)."""
    return dict(LLAMA_7B, num_hidden_layers=layers, hidden_size=hidden,
                intermediate_size=hidden * LLAMA_7B["intermediate_size"] // LLAMA_7B["hidden_size"],
                num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=vocab)


def llama_config(shape, seq):
    """transformers.LlamaConfig of `shape` (a LLAMA_SHAPES value), untied head, positions for seq."""
    transformers = import_transformers()
    return transformers.LlamaConfig(**shape, max_position_embeddings=max(2048, seq), tie_word_embeddings=False)


def llama_param_count(shape):
    """The parameter count of LlamaForCausalLM of `shape` (untied head, no biases), by arithmetic."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * v * h + shape["num_hidden_layers"] * layer + h


def lora_wrap(model):
    """peft.get_peft_model(model, LoraConfig(**LORA)) under torch.manual_seed(2): the adapters are
    made outside any zero.Init (the engine takes them at initialize), the same in every contender."""
    import peft
    import torch
    torch.manual_seed(2)
    return peft.get_peft_model(model, peft.LoraConfig(**LORA))


# ---------------------------------------------------------------- configuration

def ds_config(*, hidden, batch, nvme_dir, sub_group_size, buffer_size, offload=True, offload_device="nvme",
              tiermem=None):
    """The ds_config of every offloading contender: stage 3; bucket sizes as HF's "auto" derives
    them from the hidden size (reduce_bucket_size H*H, stage3_prefetch_bucket_size 0.9*H*H,
    stage3_param_persistence_threshold 10*H); with `offload`, offload_param {nvme, buffer_count 5,
    buffer_size (elements), max_in_cpu 1e9} and offload_optimizer {nvme, buffer_count 4} in
    nvme_dir, pin_memory false (the CPU accelerator has none); with `offload_device` "cpu" both in
    host RAM instead (pin_memory false); AdamW lr 1e-4, betas (0.9, 0.999),
    eps 1e-8, weight decay 0.01; clipping 1.0; aio block 1 MiB, queue depth 8. `tiermem`: the
    config's tiermem section, when given."""
    zero = {"stage": 3, "sub_group_size": int(sub_group_size),
            "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
    if offload and offload_device == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif offload:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 5,
                                 "buffer_size": int(buffer_size), "max_in_cpu": int(1e9)}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                                     "buffer_count": 4}
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
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
    if tiermem:
        cfg["tiermem"] = dict(tiermem)
    return cfg


def worker_env(threads, single_rank=False):
    """The environment of a worker process: OMP_NUM_THREADS=threads, OMP_WAIT_POLICY=PASSIVE,
    DS_ACCELERATOR=cpu, TOKENIZERS_PARALLELISM=false, over this process's; `single_rank`: without a
    launcher's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false")
    if single_rank:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
    return env


def add_worker_flags(p):
    """The flags of a script that runs its contenders as workers of itself: --threads, --json and
    the hidden --worker NAME and --work DIR."""
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)


def free_port():
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_deepspeed_gloo(single_process=True):
    """deepspeed.init_distributed with gloo, DeepSpeed's logger at WARNING. single_process: as rank
    0 of 1 on a free local port (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* set here); else from
    torchrun's environment."""
    import logging

    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    if single_process:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


# ---------------------------------------------------------------- measuring

def plain_step(model, data, clip):
    """The plain loop's step on `model` (put in training mode): torch.optim.AdamW over its trainable
    parameters with the offloading contenders' hyper-parameters (ds_config), clipping at `clip`
    when > 0. Returns step(), which runs one step on `data` (input_ids and labels) and returns the
    loss."""
    import torch
    model.train()
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def step():
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def engine_step(engine, data):
    """One training step of a DeepSpeed-shaped engine (DeepSpeed's or tiermem.torch's) on one token
    batch used as input_ids and labels; returns the loss."""
    loss = engine(input_ids=data, labels=data).loss
    engine.backward(loss)
    engine.step()
    return loss


def timed_steps(step, steps, before=None, after=None):
    """Runs step() `steps` times; returns (wall seconds of each, float loss of each). before(i) is
    called before step i is timed, after(i, seconds, loss) after it (both optional, outside the
    timing)."""
    times, losses = [], []
    for i in range(steps):
        if before:
            before(i)
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        if after:
            after(i, times[-1], losses[-1])
    return times, losses


def max_rss_bytes():
    """This process's peak resident set (getrusage ru_maxrss), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_io():
    """(read_bytes, write_bytes) of this process from /proc/self/io: what it had the block layer
    read and write (storage I/O, all threads; page-cache hits are not counted, dirtied pages are)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                out[k] = int(v)
    except OSError:
        return (0, 0)
    return (out.get("read_bytes", 0), out.get("write_bytes", 0))


def rss_marks():
    """(VmRSS, VmHWM) of this process now, in bytes: where the max RSS was reached."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("VmRSS:", "VmHWM:")):
                out[ln.split(":")[0]] = int(ln.split()[1]) * 1024
    return [out.get("VmRSS", 0), out.get("VmHWM", 0)]


def scalar_stats(engine):
    """tiermem.torch engine.stats() without its nested values (what a result's JSON keeps), and
    its per-phase NVMe figures (`phases`: forward, backward, optimizer, other, outside)."""
    st = engine.stats()
    out = {k: v for k, v in st.items() if isinstance(v, (int, float, str))}
    if isinstance(st.get("phases"), dict):
        out["phases"] = st["phases"]
    return out


# ---------------------------------------------------------------- the machine

def cpu_name():
    """(the CPU's model name, whether it has AVX-512F), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "unknown", False
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return name, " avx512f" in flags


def loadavg():
    """The 1-minute load average (nan when /proc/loadavg cannot be read)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


# ---------------------------------------------------------------- tiermem-plan --check of a run

def model_dims(model, seq):
    """The dimensions tiermem-plan reads of a transformers model's config: n_layer, n_head, d_model,
    context, vocab (GPT-2's and Llama's names), and seq_len."""
    c = model.config

    def first(*names):
        return next(int(getattr(c, n)) for n in names if getattr(c, n, None) is not None)
    return {"n_layer": first("n_layer", "num_hidden_layers"), "n_head": first("n_head", "num_attention_heads"),
            "d_model": first("n_embd", "hidden_size"), "context": first("n_positions", "max_position_embeddings"),
            "vocab": first("vocab_size"), "seq_len": seq}


def model_flops_per_token(model, seq, engine=None):
    """A training step's model FLOPs per token (multiply-add = 2), counted as tiermem-train counts its
    GPT's (gpt::flops_per_token): every linear layer's weight (torch.nn.Linear, transformers' Conv1D,
    a tied head included) once per token forward, and the attention's q.k and att.v over `seq` keys,
    2 x seq x d_model per layer; backward twice the forward, except a frozen weight's, once (its
    input's gradient only). With `engine`, the weights' sizes from its units (a managed parameter
    holds a placeholder)."""
    import torch
    if engine is not None:
        numel = {id(p): (n, u.frozen) for u in engine.units for p, _, n in u.params}
    else:
        numel = {id(p): (p.numel(), not p.requires_grad) for p in model.parameters()}
    trained = frozen = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":
            n, is_frozen = numel[id(m.weight)]
            if is_frozen:
                frozen += n
            else:
                trained += n
    d = model_dims(model, seq)
    attention = d["n_layer"] * 2 * seq * d["d_model"]
    return 2.0 * (3 * trained + 2 * frozen + 3 * attention)


class PlanSummary:
    """A tiermem.torch run as tiermem-train's --json summary gives one (the fields tiermem-plan --check
    reads; docs/plan.md, "Checking a tiermem.torch run"), so that the planner's prediction for the same
    configuration can be held against it. step() runs one step as engine_step does, timing
    engine.step(); summary() gives, over the steps after the first `skip`:
      step_seconds       their median wall time (what compare_torch.py reports)
    and of each step's time, as shares (each the median over those steps, as tiermem-train's):
      optimizer_share    engine.step()'s wall time and the deferred updates the gathers applied or
                         waited for (ZeroStats deferred_update_ns), as tiermem-train counts them
      io_wait_share      the driving thread's waits (driving_stall_ns) less those of the optimizer
                         (deferred_update_stall_ns and the waits inside engine.step())
      communication_share  0: one rank (the gathers' own time is the hooks', in the compute)
      compute_share      the rest: torch's forward and backward, and the hooks;
    the engine's peaks (host: its pool, bounce buffers and buffers, and on
    the CPU the SimDevice's memory, as tiermem-train counts them; torch's own activations and
    gradients are not the engine's) and the state it homes on NVMe; and under
    plan_inputs the model as the engine sees it: its units' sizes in engine order, which are frozen,
    the FLOPs per token (model_flops_per_token) and whether the head is tied."""

    def __init__(self, engine, model, config, data, name, skip=2, sim_device=True):
        self.engine, self.model, self.config, self.data = engine, model, config, data
        self.sim_device = sim_device  # the engine's device is a SimDevice (host memory): the CPU benches
        self.name, self.skip = name, skip
        self.rows = []  # per step: wall, step() wall, waits in step(), stats after

    def counters(self):
        st = self.engine.stats()
        return {k: st[k] for k in ("driving_stall_ns", "deferred_update_ns", "deferred_update_stall_ns")}

    def step(self):
        if not self.rows:
            self.start = self.counters()
        t0 = time.perf_counter()
        loss = self.engine(input_ids=self.data, labels=self.data).loss
        self.engine.backward(loss)
        s0 = self.engine.stats()["driving_stall_ns"]
        t1 = time.perf_counter()
        self.engine.step()
        t2 = time.perf_counter()
        waits = self.engine.stats()["driving_stall_ns"] - s0
        self.rows.append({"wall": t2 - t0, "step": t2 - t1, "step_waits_ns": waits, "after": self.counters()})
        return loss

    @staticmethod
    def nvme_bytes(st):
        """The state homed on NVMe, as the engine counts it (tiermem-train's nvme_peak_bytes is its
        plan's): working shards, optimizer state and gradient partitions whose home is nvme. (The swap
        files' sizes are larger: the files grow in whole extents.)"""
        return sum(st[k] for k, home in (("param_store_bytes", "param_home"), ("optimizer_state_bytes", "optimizer_home"),
                                         ("gradient_bytes", "gradient_home")) if st[home] == "nvme")

    def summary(self):
        import statistics
        e, st = self.engine, self.engine.stats()
        skip = self.skip if len(self.rows) > self.skip else 0
        shares = {"compute": [], "io_wait": [], "optimizer": []}
        for i in range(skip, len(self.rows)):
            r, before = self.rows[i], (self.rows[i - 1]["after"] if i else self.start)

            def delta(k):
                return (r["after"][k] - before[k]) / 1e9
            optimizer = r["step"] + delta("deferred_update_ns")
            io_wait = max(0.0, delta("driving_stall_ns") - delta("deferred_update_stall_ns") - r["step_waits_ns"] / 1e9)
            for k, v in (("optimizer", optimizer), ("io_wait", io_wait),
                         ("compute", max(0.0, r["wall"] - optimizer - io_wait))):
                shares[k].append(min(1.0, v / r["wall"]))
        rows = self.rows[skip:]
        wall = sum(r["wall"] for r in rows)
        units = e.units
        dims = model_dims(self.model, self.data.shape[1])
        head = getattr(self.model, "get_output_embeddings", lambda: None)()
        inputs = getattr(self.model, "get_input_embeddings", lambda: None)()
        tied = head is not None and inputs is not None and head.weight is inputs.weight
        return {
            "model": self.name, "steps": len(self.rows), "world_size": e.world_size,
            "zero_stage": self.config["zero_optimization"]["stage"],
            "param_offload": st["param_home"], "optimizer_offload": st["optimizer_home"],
            "host_budget_bytes": st["host_budget_bytes"], "device_budget_bytes": st["device_budget_bytes"],
            "step_seconds": statistics.median(r["wall"] for r in rows),
            "step_seconds_mean": wall / len(rows), "steady_seconds": wall,
            **{k + "_share": statistics.median(v) for k, v in shares.items()}, "communication_share": 0.0,
            "device_peak_bytes": st["device_peak_bytes"],
            "host_peak_bytes": st["host_pool_peak_bytes"] + st["host_bounce_bytes"] + st["host_engine_peak_bytes"] +
                               (st["device_peak_bytes"] if self.sim_device else 0),
            "nvme_peak_bytes": self.nvme_bytes(st),
            # The host peak's parts, as tiermem-train's summary names them.
            "host_pool_peak_bytes": st["host_pool_peak_bytes"], "host_bounce_bytes": st["host_bounce_bytes"],
            "host_engine_peak_bytes": st["host_engine_peak_bytes"],
            "host_sim_device_bytes": st["device_peak_bytes"] if self.sim_device else 0,
            "plan_inputs": {"batch": int(self.data.shape[0]), "grad_accum": 1,
                            **{k: dims[k] for k in ("seq_len", "n_layer", "n_head", "d_model", "context", "vocab")},
                            "modules": [u.numel for u in units], "frozen": [bool(u.frozen) for u in units],
                            "flops_per_token": model_flops_per_token(self.model, dims["seq_len"], e),
                            "head_tied": tied},
        }

    def write(self, path):
        """The summary as tiermem-plan --check reads it ({"summary": ...}), and the run's ds_config beside it
        (path + ".config.json", for --config)."""
        import json
        with open(path, "w") as f:
            json.dump({"summary": self.summary()}, f)
        with open(path + ".config.json", "w") as f:
            json.dump(self.config, f)


def model_rate(model, data, steps=6, seconds=3.0):
    """The model's own forward + backward (the loss included; no engine, no optimizer) in model FLOP/s
    (model_flops_per_token): the median of at least `steps` steps and `seconds` of them, after two
    unmeasured ones (a tiny model's 0.1 s steps need the seconds): what tiermem-bench profile's
    compute_gflops is for tiermem-train's GPT, for this model. Returns (GFLOP/s, seconds a step)."""
    import statistics
    flops = model_flops_per_token(model, data.shape[1]) * data.numel()
    times = []
    while len(times) < steps + 2 or sum(times[2:]) < seconds:
        t0 = time.perf_counter()
        model(input_ids=data, labels=data).loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    s = statistics.median(times[2:])
    return flops / s / 1e9, s


def rate_profile(profile, out_path, gflops, what):
    """`profile` (a tiermem-bench profile --json output) with its compute rate replaced by `gflops`
    (the model's own rate, model_rate), written to out_path: the by-width tables go (they are
    tiermem-train's GPT's), `sources` says where the figure came from."""
    import json
    with open(profile) as f:
        j = json.loads([ln for ln in f if ln.lstrip().startswith("{")][-1])
    p = j.get("profile", j)
    for k in ("compute_gflops_by_width", "compute_gflops_by_width_128"):
        p.pop(k, None)
    p["compute_gflops"] = gflops
    p["name"] = f"{p.get('name', profile)}, compute_gflops {what}"
    p.setdefault("sources", {})["compute_gflops"] = what
    with open(out_path, "w") as f:
        json.dump({"profile": p}, f)


def plan_check(plan_bin, summary_path, profile):
    """tiermem-plan --check of a PlanSummary file against `profile` (tiermem-bench profile --json's
    output), with the run's ds_config: {field: (predicted, measured)} for the step time, the four
    shares and the three peaks, or {"error": ...}."""
    import json
    import subprocess
    cmd = [plan_bin, "--check", summary_path, "--config", summary_path + ".config.json", "--profile", profile, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}", "command": " ".join(cmd)}
    j = json.loads(r.stdout.strip().splitlines()[-1])
    fields = ("step_seconds", "compute_share", "io_wait_share", "communication_share", "optimizer_share",
              "device_peak_bytes", "host_peak_bytes", "nvme_peak_bytes")
    return {f: (j[f + "_predicted"], j[f + "_measured"]) for f in fields}


def plan_check_line(name, c, rate="the profile's rate"):
    """One line of a plan_check result: the step's signed error, the shares, the peaks' errors."""
    if "error" in c:
        return f"plan check {name:13s} FAILED {c['error']}"
    name = f"{name} ({rate})"

    def err(f):
        p, m = c[f]
        return f"{100 * (p / m - 1):+.1f} %" if m else ("0" if not p else "(0 measured)")
    shares = ", ".join(f"{k} {100 * c[k + '_share'][0]:.0f}/{100 * c[k + '_share'][1]:.0f} %"
                       for k in ("compute", "io_wait", "optimizer"))
    return (f"plan check {name:34s} step {c['step_seconds'][0]:.3f} s predicted, {c['step_seconds'][1]:.3f} s measured "
            f"({err('step_seconds')}); shares predicted/measured: {shares}; peaks device {err('device_peak_bytes')}, "
            f"host {err('host_peak_bytes')}, nvme {err('nvme_peak_bytes')}")
