"""The differential harness of test_torch_parity.py: plain PyTorch and tiermem.torch trained side by
side from identical initial weights on the same data, compared at every optimizer step on the loss,
every trainable parameter's gradient (tiermem: `utils.safe_get_full_grad` after backward, before the
step; plain: `p.grad` summed over the micro-batches) and every trainable parameter after the update
(tiermem: `utils.safe_get_full_fp32_param`).

A cell is one point of the matrix (`Cell`): model family, what trains, activation checkpointing,
precision, gradient accumulation, offload, entry point (own loop, HF Trainer, TRL SFT/DPO/GRPO) and ranks.
`run_cell(cell, tmp)` trains both sides and returns the worst differences (`Result`); `check(result)`
says which exceed the cell's tolerances. The HF Trainer and TRL entry points run in a child process
(`python parity.py cells <in.json> <out.json>`): accelerate wraps a model in DDP when
torch.distributed is initialised in the process, as other tests here leave it. Two ranks run under
torchrun (`python parity.py dist <out.json> <swap>`), compared with the plain single-process run on
the concatenated batch.

Differences are max-abs relative per tensor: max|a - b| / max|b|."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import VOCAB, SEQ, MICRO  # noqa: E402

FAMILIES = ("llama", "gpt2", "mixtral", "t5")
TRAINS = ("full", "lora", "frozen")
# "default": model.gradient_checkpointing_enable() without kwargs (transformers 5.23: use_reentrant=False).
CKPTS = ("none", "reentrant", "nonreentrant", "default")
# "autocast": fp32 weights, forward under torch.autocast("cpu", bfloat16) as the HF Trainer runs bf16=True on
# the CPU; "bf16": the config's "bf16": {"enabled": true} against a bf16 model with fp32 master weights.
PRECISIONS = ("fp32", "autocast", "bf16")
GAS = (1, 3)
OFFLOADS = ("none", "cpu", "nvme")
ENTRIES = ("loop", "trainer", "sft", "dpo", "grpo")
CAUSAL = ("llama", "gpt2", "mixtral")

STEPS = 3      # optimizer steps per cell (own loop and HF Trainer)
TRL_STEPS = 5  # ... and per TRL cell (the SFT and DPO runs were 5 steps)


def steps_of(cell) -> int:
    return TRL_STEPS if cell.entry in ("sft", "dpo", "grpo") else STEPS
LR = 1e-3
CLIP = 1.0
# Budgets at which units page every step for these models (about 0.1-0.2 MiB of parameters, optimizer
# state beside them; checked with stats(): NVMe reads and host-to-device copies at every step): offload
# nvme pages from NVMe; offload cpu must home everything in host memory (the engine refuses less) and
# pages the device tier from it. A device budget of 64 KiB is accepted by initialize but runs out of
# device memory in the recompute of non-reentrant checkpointing. acquire_timeout_s: a tier that stays
# full fails the cell in 5 s instead of the default 30.
BUDGETS = {"nvme": {"host_budget_bytes": "256KiB", "device_budget_bytes": "128KiB", "acquire_timeout_s": 5},
           "cpu": {"host_budget_bytes": "4MiB", "device_budget_bytes": "128KiB", "acquire_timeout_s": 5}}
LORA_R = 4
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "mixtral": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "t5": ["q", "v"]}

# Tolerances. loss: relative, every logged loss. grad1 / param1: max-abs relative per tensor at the first
# step. grad / param: max-abs relative per tensor at every step (param: after the update). param_lr,
# max|a - b| / (LR * step), is checked for bf16 and reported for fp32.
# - fp32: one computation on both sides; only summation order and the AdamW kernel's FMA differ
#   (measured: losses within 1e-7, gradients within 1.2e-6). Parameters after the first step: 1e-3, for
#   tensors that start at zero (GPT-2's biases): after two steps their largest element is about 2 LR,
#   and Adam's normalised update turns the fp32 summation-order differences of a gradient element near
#   zero into a visible share of it (measured 2.7e-4 on GPT-2's c_attn.bias; other tensors 1e-6).
# - autocast and bf16: the first step computes on identical values on both sides and must agree as fp32
#   does (grad1, param1; measured 0 and 5e-7). After it the fp32 master weights differ by ulps (tiermem's
#   AdamW kernel against torch's), which can move the bf16 rounding of a weight by one bf16 ulp (2^-8
#   relative) and, through it, later gradients and updates. Plain PyTorch against itself, one run's
#   parameters nudged by one fp32 ulp after step 1, differs by as much as tiermem does on the same
#   tensors (the Trainer/TRL part of the full matrix: gradients up to 2.7e-2 after step 1 against
#   tiermem's 1.4e-2; zero-initialised biases moved by Adam's normalised update up to 0.77 relative
#   both ways). So after step 1 bf16 gradients are held to 5e-2, and parameters in learning-rate steps
#   (param_lr: max|a - b| / (LR * step) <= 2, an update of the other sign at most), not relative.
TOL = {
    "fp32": {"loss": 1e-5, "grad1": 1e-4, "grad": 1e-4, "param1": 1e-4, "param": 1e-3},
    "autocast": {"loss": 1e-3, "grad1": 1e-4, "grad": 5e-2, "param1": 1e-4, "param_lr": 2.0},
    "bf16": {"loss": 1e-3, "grad1": 1e-4, "grad": 5e-2, "param1": 1e-4, "param_lr": 2.0},
}


@dataclasses.dataclass(frozen=True)
class Cell:
    family: str = "llama"
    trains: str = "lora"
    ckpt: str = "none"
    precision: str = "fp32"
    gas: int = 1
    offload: str = "nvme"
    entry: str = "loop"
    ranks: int = 1

    @property
    def id(self) -> str:
        return (f"{self.entry}-{self.family}-{self.trains}-ckpt_{self.ckpt}-{self.precision}-gas{self.gas}-"
                f"{self.offload}" + (f"-x{self.ranks}" if self.ranks > 1 else ""))

    def in_child(self) -> bool:
        return self.entry != "loop"


def full_matrix() -> list:
    """The full cross product: every axis for the own loop; for the HF Trainer and TRL every family they
    train (TRL's SFT, DPO and GRPO: the causal ones), what trains, checkpointing, precision and accumulation,
    with offload nvme (what an entry point does to the model does not depend on the tier) and, for the
    TRL trainers, fp32 and autocast (their bf16=True is autocast)."""
    cells = [Cell(f, t, c, p, g, o, "loop") for f, t, c, p, g, o in
             itertools.product(FAMILIES, TRAINS, CKPTS, PRECISIONS, GAS, OFFLOADS)]
    cells += [Cell(f, t, c, p, g, "nvme", "trainer") for f, t, c, p, g in
              itertools.product(FAMILIES, TRAINS, CKPTS, ("fp32", "autocast"), GAS)]
    for entry in ("sft", "dpo", "grpo"):
        cells += [Cell(f, t, c, p, g, "nvme", entry) for f, t, c, p, g in
                  itertools.product(CAUSAL, TRAINS, CKPTS, ("fp32", "autocast"), GAS)]
    return cells


# ---------------------------------------------------------------------------------------------------
# models and data


def build(family: str, seed: int = 0):
    """A tiny model of the family from a config, no dropout (both sides then run the same computation
    without sharing an RNG stream)."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64, **common)
        return transformers.LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64, **common)
        return transformers.MixtralForCausalLM(cfg)
    if family == "t5":
        cfg = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                                    decoder_start_token_id=0, **common)
        return transformers.T5ForConditionalGeneration(cfg)
    raise ValueError(family)


def micro_batches(family: str, n: int, seed: int = 1) -> list:
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (MICRO, SEQ), generator=g)
        if family == "t5":
            out.append({"input_ids": ids, "labels": torch.randint(3, VOCAB, (MICRO, SEQ // 2), generator=g)})
        else:
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def prepare(cell: Cell, seed: int = 0):
    """The model as the user hands it over: built, PEFT-wrapped or partly frozen, checkpointing on."""
    import torch
    model = build(cell.family, seed)
    if cell.trains == "lora":
        import peft
        torch.manual_seed(123)
        lcfg = peft.LoraConfig(r=LORA_R, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[cell.family],
                               fan_in_fan_out=cell.family == "gpt2")
        model = peft.get_peft_model(model, lcfg)
    elif cell.trains == "frozen":
        for m in frozen_part(model, cell.family):
            m.requires_grad_(False)
    if cell.ckpt != "none" and cell.entry == "loop":
        enable_checkpointing(model, cell.ckpt)
    return model


def frozen_part(model, family: str) -> list:
    """The embeddings and the first layer (T5: the shared embedding and the encoder's first block)."""
    if family in ("llama", "mixtral"):
        return [model.model.embed_tokens, model.model.layers[0]]
    if family == "gpt2":
        return [model.transformer.wte, model.transformer.wpe, model.transformer.h[0]]
    return [model.shared, model.encoder.block[0]]


def ckpt_kwargs(ckpt: str):
    return {"reentrant": {"use_reentrant": True}, "nonreentrant": {"use_reentrant": False}}.get(ckpt)


def enable_checkpointing(model, ckpt: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23: gradient_checkpointing_enable is a deprecated alias
        kw = ckpt_kwargs(ckpt)
        if kw is None:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def ds_config(cell: Cell, swap: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": cell.gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if cell.offload != "none":
        for k in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][k] = {"device": cell.offload, "nvme_path": swap}
        cfg["tiermem"] = dict(BUDGETS[cell.offload])
    if cell.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def trainable(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _autocast(cell: Cell):
    import contextlib

    import torch
    if cell.precision == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------
# comparison


def rel(a, b) -> float:
    """max|a - b| / max|b| (a zero b: max|a|, so equal zeros give 0)."""
    a = a.detach().double()
    b = b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    d = (a - b).abs().max().item()
    m = b.abs().max().item()
    if not math.isfinite(d):
        return math.inf
    return d / m if m > 0 else d


def compare(plain: dict, tm: dict) -> dict:
    """plain/tm: {"loss": [per logged loss], "grads": [{name: tensor} per step], "params": [...]}."""
    out = {"steps": len(plain["grads"]), "loss": 0.0, "loss_at": None, "grad": 0.0, "grad_at": None, "param": 0.0,
           "param_at": None, "param_lr": 0.0, "param_lr_at": None, "grad_by_step": [], "param_by_step": [],
           "missing": [], "grad_max": 0.0}

    def note(kind, r, where):
        r = r if r == r else math.inf  # NaN counts as infinitely far
        if out[kind + "_at"] is None or r > out[kind]:
            out[kind], out[kind + "_at"] = r, where

    if len(plain["loss"]) != len(tm["loss"]):
        out["missing"].append(f"losses: {len(tm['loss'])} logged, {len(plain['loss'])} plain")
    for i, (a, b) in enumerate(zip(tm["loss"], plain["loss"])):
        note("loss", abs(a - b) / abs(b) if b else abs(a), f"loss {i + 1}")
    for kind in ("grad", "param"):
        if len(plain[kind + "s"]) != len(tm[kind + "s"]):
            out["missing"].append(f"{kind}s: {len(tm[kind + 's'])} steps, {len(plain[kind + 's'])} plain")
        for s, (pa, ta) in enumerate(zip(plain[kind + "s"], tm[kind + "s"])):
            worst = 0.0
            for name, b in pa.items():
                a = ta.get(name)
                if kind == "grad" and b is not None and b.numel():
                    out["grad_max"] = max(out["grad_max"], b.abs().max().item())
                if a is None and b is None:
                    r = 0.0
                elif a is None:
                    r = 0.0 if b.abs().max() == 0 else math.inf
                    if r:
                        out["missing"].append(f"{kind} {name} step {s + 1}")
                elif b is None:
                    r = a.abs().max().item()
                else:
                    r = rel(a, b)
                    if kind == "param":
                        d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                        note("param_lr", d / (LR * (s + 1)), f"{name} step {s + 1}")
                worst = max(worst, r if r == r else math.inf)
                note(kind, r, f"{name} step {s + 1}")
            out[kind + "_by_step"].append(worst)
    return out


def check(cell: Cell, result: dict) -> list:
    """The differences over the cell's tolerances, as sentences (empty: the cell passes)."""
    if "error" in result:
        return [f"raised: {result['error']}"]
    tol = TOL[cell.precision]
    bad = []
    firsts = {"grad1": (result["grad_by_step"] or [math.inf])[0], "param1": (result["param_by_step"] or [math.inf])[0]}
    for k in ("loss", "grad1", "grad", "param1", "param", "param_lr"):
        if k not in tol:
            continue
        v = firsts.get(k, result.get(k))
        if not v <= tol[k]:
            where = f" (worst at {result[k + '_at']})" if k + "_at" in result else ""
            bad.append(f"{k} off by {v:.3g} > {tol[k]:g}{where}")
    if result["missing"]:
        bad.append("missing: " + ", ".join(result["missing"][:4]))
    if result.get("grad_max", 1.0) == 0.0:
        bad.append("every plain gradient is zero at every step: the cell compares nothing")
    return bad


def summary(result: dict) -> str:
    if "error" in result:
        return "error: " + result["error"]
    return (f"loss {result['loss']:.2e} (step {result['loss_at']}), grad {result['grad']:.2e} ({result['grad_at']}), "
            f"param {result['param']:.2e} ({result['param_at']}), param/(lr*step) {result['param_lr']:.2f}; "
            f"grad by step {['%.1e' % v for v in result['grad_by_step']]}")


def _snap(named) -> dict:
    return {n: p.detach().float().clone() for n, p in named}


# ---------------------------------------------------------------------------------------------------
# the own loop


def plain_loop(cell: Cell, model, data) -> dict:
    """torch.optim.AdamW on the plain model (fp32 and autocast), or (bf16) a bf16 copy computing with
    fp32 master copies of the trainable parameters stepped by torch.optim.AdamW, gradients accumulated in
    fp32 over the micro-batches as DeepSpeed's bf16 optimizer does."""
    import torch
    model.train()
    if cell.precision == "bf16":
        # The masters are the fp32 model's values, taken before the model is rounded to bf16.
        masters = [p.detach().float().clone().requires_grad_(True) for _, p in trainable(model)]
        for p in model.parameters():  # parameters only: buffers keep their dtype, as in DeepSpeed's engine
            p.data = p.data.to(torch.bfloat16)
    else:
        masters = [p for _, p in trainable(model)]
    named = trainable(model)
    opt = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    rec = {"loss": [], "grads": [], "params": []}
    for s in range(STEPS):
        for k in range(cell.gas):
            b = data[s * cell.gas + k]
            with _autocast(cell):
                loss = model(**b).loss
            (loss / cell.gas).backward()
            rec["loss"].append(loss.item())
            if cell.precision == "bf16":
                for (_, p), mp in zip(named, masters):
                    if p.grad is not None:
                        g = p.grad.float()
                        mp.grad = g if mp.grad is None else mp.grad + g
                        p.grad = None
        rec["grads"].append({n: (mp.grad.detach().clone() if mp.grad is not None else None)
                             for (n, _), mp in zip(named, masters)})
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        opt.step()
        opt.zero_grad()
        if cell.precision == "bf16":
            with torch.no_grad():
                for (_, p), mp in zip(named, masters):
                    p.copy_(mp.to(torch.bfloat16))
        rec["params"].append({n: mp.detach().float().clone() for (n, _), mp in zip(named, masters)})
    return rec


def tiermem_loop(cell: Cell, model, data, swap: str) -> dict:
    import tiermem.torch as tt
    from tiermem.torch import utils
    named = trainable(model)
    engine, *_ = tt.initialize(model=model, config=ds_config(cell, swap))
    rec = {"loss": [], "grads": [], "params": []}
    try:
        for s in range(STEPS):
            for k in range(cell.gas):
                b = data[s * cell.gas + k]
                with _autocast(cell):
                    loss = engine(**b).loss
                engine.backward(loss)
                rec["loss"].append(loss.item())
                if k == cell.gas - 1:
                    rec["grads"].append({n: utils.safe_get_full_grad(p) for n, p in named})
                engine.step()
            rec["params"].append({n: utils.safe_get_full_fp32_param(p) for n, p in named})
    finally:
        engine.close()
    return rec


def run_loop(cell: Cell, tmp: str) -> dict:
    model = prepare(cell)
    plain = copy.deepcopy(model)
    data = micro_batches(cell.family, STEPS * cell.gas)
    want = plain_loop(cell, plain, data)
    swap = os.path.join(tmp, "swap")
    os.makedirs(swap, exist_ok=True)
    got = tiermem_loop(cell, model, data, swap)
    return compare(want, got)


# ---------------------------------------------------------------------------------------------------
# the HF Trainer and TRL (in a child process)


def tokenizer():
    """A word-level tokenizer over the model's vocabulary ("t0" ... "t127"), built offline."""
    import tokenizers
    import transformers
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                                bos_token="t2", unk_token="t3")


def _dataset(cell: Cell, n: int):
    import torch
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        if cell.entry == "dpo":
            def words(k):
                return " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (k,), generator=g))
            rows.append({"prompt": words(6), "chosen": words(5), "rejected": words(5)})
        elif cell.entry == "grpo":
            rows.append({"prompt": " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (6,), generator=g))})
        elif cell.family == "t5":
            rows.append({"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=g).tolist(),
                         "labels": torch.randint(3, VOCAB, (SEQ // 2,), generator=g).tolist()})
        else:
            ids = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
            rows.append({"input_ids": ids} if cell.entry == "sft" else {"input_ids": ids, "labels": ids})
    if cell.entry in ("sft", "dpo", "grpo"):
        import datasets
        return datasets.Dataset.from_list(rows)
    return [{k: torch.tensor(v) for k, v in r.items()} for r in rows]


def _recorder(cell: Cell, model, side: str, rec: dict):
    import torch
    import transformers
    named = trainable(model)

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if side == "plain":
                # The Trainer clipped p.grad before this callback; the plain side shows clipped gradients.
                rec["grads"].append({n: (p.grad.detach().float().clone() if p.grad is not None else None)
                                     for n, p in named})
            else:
                from tiermem.torch import utils
                g = {n: utils.safe_get_full_grad(p) for n, p in named}
                # tiermem's gradients are those before clipping (the engine clips in its step, to the config's
                # gradient_clipping); scale them as torch's clip_grad_norm_ does to compare.
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double())
                                                             for t in g.values() if t is not None]))
                coef = min(1.0, CLIP / (norm.item() + 1e-6))
                rec["grads"].append({n: (t * coef if t is not None else None) for n, t in g.items()})

        def on_optimizer_step(self, args, state, control, **kw):
            if side == "plain":
                rec["params"].append(_snap(named))
            else:
                from tiermem.torch import utils
                rec["params"].append({n: utils.safe_get_full_fp32_param(p) for n, p in named})

    return Record()


def _trainer_run(cell: Cell, model, side: str, out_dir: str, swap: str, ref=None) -> dict:
    import torch
    import transformers
    rec = {"loss": [], "grads": [], "params": []}
    engine = ref_engine = None
    if side == "tiermem":
        import tiermem.torch as tt
        engine, opt, _, _ = tt.initialize(model=model, config=ds_config(cell, swap))
        if ref is not None:
            rcfg = ds_config(cell, swap + "-ref")
            os.makedirs(swap + "-ref", exist_ok=True)
            del rcfg["optimizer"]
            ref_engine, *_ = tt.initialize(model=ref, config=rcfg)
    else:
        opt = torch.optim.AdamW([p for _, p in trainable(model)], lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    common = dict(output_dir=out_dir, max_steps=steps_of(cell), per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=cell.gas, learning_rate=LR, weight_decay=0.01, max_grad_norm=CLIP,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True, bf16=cell.precision == "autocast",
                  gradient_checkpointing=cell.ckpt != "none", gradient_checkpointing_kwargs=ckpt_kwargs(cell.ckpt))
    data = _dataset(cell, steps_of(cell) * cell.gas * MICRO)
    cb = [_recorder(cell, model, side, rec)]
    try:
        if cell.entry == "trainer":
            args = transformers.TrainingArguments(**common)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched),
                                           callbacks=cb)
        elif cell.entry == "sft":
            import trl
            args = trl.SFTConfig(**common)
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(),
                                     optimizers=(opt, sched), callbacks=cb)
        elif cell.entry == "dpo":
            import trl
            args = trl.DPOConfig(**common)
            trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data,
                                     processing_class=tokenizer(), optimizers=(opt, sched), callbacks=cb)
        elif cell.entry == "grpo":
            import trl
            args = trl.GRPOConfig(**common, **GRPO_ARGS)
            trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_token_ids, args=args, train_dataset=data,
                                      processing_class=tokenizer(), optimizers=(opt, sched), callbacks=cb)
        else:
            raise ValueError(cell.entry)
        if cell.entry == "grpo":
            # Both sides sample the same completions: the same RNG state when training starts (what ran
            # before, initialize and building the trainer, draws differently on each side).
            transformers.set_seed(0)
        trainer.train()
        rec["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    finally:
        if engine is not None:
            engine.close()
        if ref_engine is not None:
            ref_engine.close()
    return rec


# GRPO (TRL 1.16 GRPOTrainer with its defaults otherwise: sampling at temperature 1, beta 0 so no
# reference model, loss_type "dapo", one iteration per generation): two completions of at most 4 tokens
# per prompt, generated by the policy itself (model.generate through the engine), no vLLM.
GRPO_ARGS = {"num_generations": 2, "max_completion_length": 4, "use_vllm": False, "log_completions": False}


def reward_token_ids(completions, **kw) -> list:
    """A deterministic reward that tells completions apart: the mean token id of the completion's words
    ("t17" is id 17), over the vocabulary."""
    out = []
    for c in completions:
        ids = [int(w[1:]) for w in c.split() if w[:1] == "t" and w[1:].isdigit()]
        out.append(sum(ids) / (len(ids) * VOCAB) if ids else 0.0)
    return out


def run_trainer(cell: Cell, tmp: str) -> dict:
    model = prepare(cell)
    plain = copy.deepcopy(model)
    ref = plain_ref = None
    if cell.entry == "dpo":
        ref = build(cell.family)   # the initial policy's base: a LoRA policy's starting point, a full one's copy
        ref.requires_grad_(False)
        ref.eval()
        plain_ref = copy.deepcopy(ref)
    swap = os.path.join(tmp, "swap")
    os.makedirs(swap, exist_ok=True)
    want = _trainer_run(cell, plain, "plain", os.path.join(tmp, "plain"), swap, plain_ref)
    got = _trainer_run(cell, model, "tiermem", os.path.join(tmp, "tm"), swap, ref)
    return compare(want, got)


def run_cell(cell: Cell, tmp: str) -> dict:
    try:
        if cell.entry == "loop":
            return run_loop(cell, tmp)
        return run_trainer(cell, tmp)
    except Exception as e:  # a refusal or a crash is the cell's result
        import traceback
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc()[-3000:]}


def run_in_child(cells: list, tmp: str, timeout: int = 1800) -> dict:
    """Runs `cells` in one child process; returns {cell.id: result}."""
    import subprocess
    path_in = os.path.join(tmp, "cells.json")
    path_out = os.path.join(tmp, "results.json")
    with open(path_in, "w") as f:
        json.dump([dataclasses.asdict(c) for c in cells], f)
    # Not a launched rank: other tests of this process set the launcher's variables.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "cells", path_in, path_out], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(path_out):
        raise RuntimeError(f"the child exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    with open(path_out) as f:
        return json.load(f)


def _child_main(path_in: str, path_out: str) -> None:
    import tempfile
    warnings.simplefilter("ignore")
    with open(path_in) as f:
        cells = [Cell(**c) for c in json.load(f)]
    out = {}
    for c in cells:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path_in)) as tmp:
            out[c.id] = run_cell(c, tmp)
        with open(path_out + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path_out + ".tmp", path_out)
    print("done", len(out))


# ---------------------------------------------------------------------------------------------------
# two ranks under torchrun

DIST_CELL = Cell("llama", "lora", "nonreentrant", "fp32", 1, "nvme", "loop", 2)


def _dist_main(path_out: str, swap: str) -> None:
    """One rank of the 2-rank cell: each rank trains on its half of every micro-batch; rank 0 also runs
    the plain single-process reference on the whole micro-batch and writes the comparison."""
    import torch
    import torch.distributed as dist
    import tiermem.torch as tt
    from tiermem.torch import utils
    warnings.simplefilter("ignore")
    cell = Cell(**json.loads(os.environ["TIERMEM_PARITY_CELL"]))
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    model = prepare(cell)
    plain = copy.deepcopy(model)
    data = [{k: torch.cat([v, v.flip(0)]) for k, v in b.items()}
            for b in micro_batches(cell.family, STEPS * cell.gas)]  # MICRO * world sequences each
    assert world == 2
    want = plain_loop(cell, plain, data) if rank == 0 else None
    cfg = ds_config(cell, os.path.join(swap, f"r{rank}"))
    # test_torch_dist's budgets: at 2 ranks the 128 KiB device budget of one rank runs out of device memory
    # in the forward (MemoryError from the gather of k_proj), after initialize accepted it.
    cfg["tiermem"].update({"host_budget_bytes": "2MiB", "device_budget_bytes": "512KiB"})
    os.makedirs(os.path.join(swap, f"r{rank}"), exist_ok=True)
    named = trainable(model)
    engine, *_ = tt.initialize(model=model, config=cfg)
    rec = {"loss": [], "grads": [], "params": []}
    for s in range(STEPS):
        for k in range(cell.gas):
            b = {key: v.chunk(world)[rank] for key, v in data[s * cell.gas + k].items()}
            loss = engine(**b).loss
            engine.backward(loss)
            t = loss.detach().clone()
            dist.all_reduce(t)
            rec["loss"].append(t.item() / world)
            if k == cell.gas - 1:
                rec["grads"].append({n: utils.safe_get_full_grad(p) for n, p in named})
            engine.step()
        rec["params"].append({n: utils.safe_get_full_fp32_param(p) for n, p in named})
    engine.close()
    if rank == 0:
        with open(path_out, "w") as f:
            json.dump(compare(want, rec), f)


if __name__ == "__main__":
    if sys.argv[1] == "cells":
        _child_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "dist":
        _dist_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} cells <in.json> <out.json> | dist <out.json> <swap>")
