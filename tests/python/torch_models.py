"""Small Hugging Face models, fixed token batches, a ds_config builder and the plain-PyTorch
reference loop the tiermem.torch tests compare against. Every model is built from a config (no
download) under a fixed seed, so two builds are equal parameter for parameter."""

from __future__ import annotations

import copy

VOCAB = 128
SEQ = 16
MICRO = 2


def hf_or_skip():
    import pytest
    try:
        import transformers
    except Exception as e:  # not installed, or a broken install
        pytest.skip(f"transformers cannot be imported: {e}")
    transformers.logging.set_verbosity_error()
    return transformers


def build(kind: str, seed: int = 0, layers: int = 2, hidden: int = 64):
    import torch
    import transformers
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=VOCAB, n_positions=32)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=32)
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(kind)


def batches(n: int, seed: int = 1):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(n)]


def ds_config(tmp_path=None, offload: str = "none", gas: int = 1, clip: float = 1.0, stage: int = 3, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if offload != "none":
        path = str(tmp_path)
        cfg["zero_optimization"]["offload_param"] = {"device": offload, "nvme_path": path}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": path}
        if stage != 3:
            del cfg["zero_optimization"]["offload_param"]
    for k, v in extra.items():
        cfg[k] = v
    return cfg


def reference_losses(model, data, steps: int, gas: int = 1, clip: float = 1.0, lr: float = 1e-3):
    """torch.optim.AdamW on the plain model: per step, the first micro-batch's loss; the loss of
    each micro-batch divided by gas before backward (the gradient of the mean)."""
    import torch
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    out = []
    for s in range(steps):
        for k in range(gas):
            b = data[s * gas + k]
            loss = model(input_ids=b, labels=b).loss
            (loss / gas).backward()
            if k == 0:
                out.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return out


def bf16_master_reference(model, data, clip: float = 1.0, lr: float = 1e-3):
    """Mixed-precision training as the reference for bf16 runs: a bf16 copy of `model` computes,
    fp32 master copies of its trainable parameters (the fp32 model's values) are clipped and
    stepped by torch.optim.AdamW, then copied back rounded to nearest even. Returns the losses."""
    import torch
    ref = copy.deepcopy(model)
    for p in ref.parameters():  # parameters only: buffers keep their dtype, as in DeepSpeed's engine
        p.data = p.data.to(torch.bfloat16)
    params = [p for p in ref.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01)
    out = []
    for b in data:
        loss = ref(input_ids=b, labels=b).loss
        loss.backward()
        out.append(loss.item())
        for p, mp in zip(params, masters):
            mp.grad = p.grad.float()
            p.grad = None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.copy_(mp.to(torch.bfloat16))
    return out


def engine_losses(engine, data, steps: int, gas: int = 1):
    out = []
    for s in range(steps):
        for k in range(gas):
            b = data[s * gas + k]
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            engine.step()
            if k == 0:
                out.append(loss.item())
    return out


def assert_rel_close(got, want, rel: float):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rel * abs(b), f"step {i + 1}: {a} vs {b} (rel {abs(a - b) / abs(b):.3g} > {rel})"
