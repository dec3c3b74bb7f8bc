"""Every weight paged: frozen parameters (a PEFT LoRA base, an RL reference model) are engine state.

- PEFT LoRA on a small Llama and GPT-2 built under zero.Init, params and optimizer on NVMe at
  budgets small enough that every step pages: losses equal the same PEFT model trained with
  torch.optim.AdamW (fp32: 1e-5 relative; bf16 against a bf16 reference: 2e-3).
- The frozen base is written to NVMe at most once and never again: the NVMe traffic split by kind
  (trainable, frozen, optimizer) shows each step writing the adapters' state only.
- A model with nothing to train and a config without an 'optimizer' section gets a forward-only
  engine: the same logits and generate() tokens as the plain model; step() and backward() raise.
- The adapter saved by PEFT from a tiermem-trained model loads into a plain model.
- Bad input: a frozen-only model with an 'optimizer' section is refused before anything is written.
"""

import os

import pytest
from torch_models import (VOCAB, assert_rel_close, batches, bf16_master_reference, build, ds_config, engine_losses,
                          hf_or_skip, reference_losses)

TIGHT = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}
TIGHT_128 = {"host_budget_bytes": "1MiB", "device_budget_bytes": "1MiB"}  # hidden 128: larger units


def peft_or_skip():
    try:
        import peft
    except Exception as e:  # not installed, or a broken install
        pytest.skip(f"peft cannot be imported: {e}")
    return peft


def _lora(model, kind: str):
    peft = peft_or_skip()
    import torch
    torch.manual_seed(123)  # the adapters' init: the same in both builds
    target = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=target,
                          fan_in_fan_out=kind == "gpt2")
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_lora_under_init_equals_plain_peft(torch_or_skip, tmp_path, kind):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(10)
    # hidden 128: the frozen base (1.5 MB) is larger than the 1 MiB host budget, so it pages.
    want = reference_losses(_lora(build(kind, hidden=128), kind), data, 10)
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT_128)
    with tt.zero.Init(config=cfg):
        base = build(kind, hidden=128)
    model = _lora(base, kind)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    engine, *_ = tt.initialize(model=model, config=cfg)
    st0 = engine.stats()
    assert st0["frozen_param_bytes"] >= 4 * (n_all - n_train)  # each unit's shard padded to 1024 elements
    assert st0["frozen_param_bytes"] < 4 * (n_all - n_train) + 4 * 1024 * 64
    # Optimizer state only for the adapters (12 B per element, units aligned to 1024 elements).
    assert st0["optimizer_state_bytes"] < 12 * (n_train + 1024 * 64)
    assert st0["optimizer_state_bytes"] < 4 * (n_all - n_train)
    got = []
    written = []
    for b in data:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        written.append(engine.stats())
    assert_rel_close(got, want, 1e-5)
    st = engine.stats()
    # The base was paged in from NVMe, and not read whole at every step: the host and device caches
    # (1 MiB each) keep most of it between uses (a device copy evicted goes down to the host,
    # tiermem.demote_to_host; Llama's 1.3 MB is then read once in 10 steps).
    assert st0["frozen_param_bytes"] <= st["nvme_read_frozen_bytes"] < len(data) / 2 * st0["frozen_param_bytes"]
    # The base reached NVMe once (registration) and was never written again.
    assert st["nvme_written_frozen_bytes"] <= st0["frozen_param_bytes"]
    assert written[-1]["nvme_written_frozen_bytes"] == written[1]["nvme_written_frozen_bytes"]
    per_step = (written[-1]["nvme_written_bytes"] - written[1]["nvme_written_bytes"]) / (len(written) - 2)
    assert per_step < st0["frozen_param_bytes"] / 2, (per_step, st0["frozen_param_bytes"])
    engine.close()


def _train_by_step(engine, data, keys):
    """One engine step per batch: the losses, and for each of `keys` its engine.stats() change over
    each step (a list per key, in the order of `keys`)."""
    snaps, got = [{k: engine.stats()[k] for k in keys}], []
    for b in data:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        snaps.append({k: engine.stats()[k] for k in keys})
    return got, [[b[k] - a[k] for a, b in zip(snaps, snaps[1:])] for k in keys]


def test_the_steps_that_record_the_order_read_ahead(torch_or_skip, tmp_path):
    """The first step records the order of its accesses, reading ahead along the order the engine's
    modules were registered in (forward, then backward in reverse). Its updates are deferred into the
    second step's forward, so the second step's order is recorded afresh, reading ahead along the
    first step's forward and backward order (engine.stats()'s prefetch_hints_recording, both); the
    steps after replay the second's recording. Losses equal the plain PEFT loop's."""
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(4)
    want = reference_losses(_lora(build("llama", hidden=128), "llama"), data, 4)
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT_128)
    with tt.zero.Init(config=cfg):
        base = build("llama", hidden=128)
    engine, *_ = tt.initialize(model=_lora(base, "llama"), config=cfg)
    got, (hints, recording) = _train_by_step(engine, data, ("prefetch_hints", "prefetch_hints_recording"))
    assert recording[0] > 0 and hints[0] == recording[0], (hints, recording)
    assert recording[1] > 0 and hints[1] == recording[1], (hints, recording)
    assert recording[2:] == [0, 0] and all(h > 0 for h in hints[2:]), (hints, recording)  # replayed
    assert_rel_close(got, want, 1e-5)
    engine.close()


@pytest.mark.parametrize("bucket", [None, 20000])
def test_a_base_the_device_budget_holds_is_read_once(torch_or_skip, tmp_path, bucket):
    """A frozen base homed on NVMe that fits the device budget but not the host's is read from NVMe
    once in all, in the first step; the later steps read none of it. The first step reads ahead
    along the modules' order, to the device (the bucket) and further to host memory:
    - a weight the device read first is not read again into host memory (bucket: the default);
    - on a device whose memory is the CPU's, a host copy pushed out for room moves to free device
      room (engine.stats()'s store_promotions) instead of being dropped and read again (bucket:
      20000 elements, so that most of the read-ahead goes through the 1 MiB host budget).
    Losses equal the plain PEFT loop's."""
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(4)
    want = reference_losses(_lora(build("llama", hidden=128), "llama"), data, 4)
    cfg = ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "16MiB"})
    if bucket is not None:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket
    with tt.zero.Init(config=cfg):
        base = build("llama", hidden=128)
    engine, *_ = tt.initialize(model=_lora(base, "llama"), config=cfg)
    got, (read, promoted) = _train_by_step(engine, data, ("nvme_read_frozen_bytes", "store_promotions"))
    frozen = engine.stats()["frozen_param_bytes"]
    assert frozen > (1 << 20), frozen  # more than the host budget holds
    assert read == [frozen, 0, 0, 0], (read, frozen)
    if bucket is not None:
        assert promoted[0] > 0, promoted
    assert_rel_close(got, want, 1e-5)
    engine.close()


def test_lora_bf16_within_tolerance(torch_or_skip, tmp_path):
    """bf16 against the same PEFT model in bf16 with fp32 master copies of the adapters (as in
    test_torch_errors' bf16 test): 2e-3 relative over 10 steps."""
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(10)
    want = bf16_master_reference(_lora(build("llama"), "llama"), data)
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    cfg["bf16"] = {"enabled": True}
    with tt.zero.Init(config=cfg):
        base = build("llama")
    model = _lora(base, "llama")
    buffers = {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()}
    assert buffers, "the Llama has a floating buffer (rotary inv_freq)"
    engine, *_ = tt.initialize(model=model, config=cfg)
    # A bf16 config casts the parameters, never the buffers (DeepSpeed's engine likewise): the
    # rotary inv_freq stays fp32.
    assert {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()} == buffers
    got = engine_losses(engine, data, 10)
    assert_rel_close(got, want, 2e-3)
    engine.close()


def _forward_only_config(tmp_path):
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    del cfg["optimizer"]
    return cfg


def test_a_trained_model_without_an_optimizer_section_says_the_defaults_it_trains_with(torch_or_skip, tmp_path, capfd):
    hf_or_skip()
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "cpu")
    del cfg["optimizer"]
    engine, optimizer, _, _ = tt.initialize(model=build("llama"), config=cfg)
    banner = capfd.readouterr().err
    assert optimizer is not None
    assert engine.stats()["prefetch_eviction"] == "min"  # "auto" on an engine that trains
    assert "AdamW lr 0.001, betas (0.9, 0.999), eps 1e-08, weight_decay 0.01: the defaults, the config has no " \
           "'optimizer' section" in banner, banner
    engine.close()
    engine, _, _, _ = tt.initialize(model=build("llama"), config=ds_config(tmp_path, "cpu"))
    assert "the defaults" not in capfd.readouterr().err, "a config with the section says nothing of defaults"
    engine.close()


def test_reference_model_forward_only(torch_or_skip, tmp_path, capfd):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    plain = build("llama").eval()
    plain.requires_grad_(False)
    model = build("llama").eval()
    model.requires_grad_(False)
    engine, optimizer, _, sched = tt.initialize(model=model, config=_forward_only_config(tmp_path))
    assert optimizer is None and sched is None
    banner = capfd.readouterr().err
    assert "forward only: no optimizer; prefetch_eviction auto = aggressive" in banner, banner
    assert "master weights" not in banner, banner
    with pytest.raises(RuntimeError, match="forward-only .* no optimizer state to checkpoint"):
        engine.save_checkpoint(str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()  # nothing written
    with pytest.raises(RuntimeError, match="get_lr: this engine runs forward only"):
        engine.get_lr()
    st = engine.stats()
    assert st["optimizer_state_bytes"] == 0 and st["frozen_param_bytes"] > 0
    assert st["prefetch_eviction"] == "aggressive"  # "auto", resolved by the engine, as the banner says
    b = batches(2)[0]
    with torch.no_grad():
        assert torch.equal(engine(input_ids=b).logits, plain(input_ids=b).logits)
    prompt = b[:, :4]
    want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert st["param_home"] == "nvme"
    loss = engine(input_ids=b, labels=b).loss
    with pytest.raises(RuntimeError, match="forward only"):
        engine.backward(loss)
    with pytest.raises(RuntimeError, match="forward only"):
        engine.step()
    engine.close()


@pytest.mark.parametrize("eviction,most", [("min", 0.8), ("auto", 0.65)])
def test_forward_only_generate_reads_less_than_the_model_per_token(torch_or_skip, tmp_path, eviction, most):
    """generate() runs the model's forward once per token over the same modules. On a forward-only
    engine each forward is one traced pass (ZeroEngine.end_forward_pass): with host and device
    caches smaller than the model, the passes after the first read ahead and evict by next use, so
    a token reads less than the whole base from NVMe (before, gathers outside a training step
    were untraced, and LRU over the cycle kept nothing: every token read the whole base). The
    tokens equal the plain model's. tiermem.prefetch_eviction "min" reads least; "auto" (aggressive
    on a forward-only engine) reads ahead of each use, evicting cached weights used later, so reads
    more: what MIN reads and a window of a quarter of each budget a token (0.35 + 2 x 0.0875 of the
    base at most). Without that window the cache slid ahead of the compute and every token read the
    whole base (1.04-1.12 of it, measured)."""
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    plain = build("llama", layers=6, hidden=128).eval()
    plain.requires_grad_(False)
    base = sum(p.numel() * 4 for p in plain.parameters())
    model = build("llama", layers=6, hidden=128).eval()
    model.requires_grad_(False)
    cfg = _forward_only_config(tmp_path)
    budget = (int(base * 0.35) + 4095) // 4096 * 4096
    cfg["tiermem"] = dict(cfg.get("tiermem", {}), host_budget_bytes=budget, device_budget_bytes=budget,
                          prefetch_eviction=eviction)
    engine, *_ = tt.initialize(model=model, config=cfg)
    assert engine.stats()["prefetch_eviction"] == ("min" if eviction == "min" else "aggressive")
    prompt = batches(1)[0][:, :4]
    new = 6
    want = plain.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)  # records, warms
        assert torch.equal(got, want)
        before = engine.stats()["nvme_read_bytes"]
        got = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
        read = engine.stats()["nvme_read_bytes"] - before
    assert torch.equal(got, want)
    assert 0 < read < most * new * base, (read, new * base)
    engine.close()


def test_frozen_only_model_with_optimizer_section_is_refused(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    model = build("gpt2")
    model.requires_grad_(False)
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(ValueError, match="optimizer"):
        tt.initialize(model=model, config=ds_config(swap, "nvme", tiermem=TIGHT))
    assert os.listdir(swap) == []  # refused before anything was written
    # The model is untouched: it still runs as plain torch.
    b = batches(1)[0]
    assert model(input_ids=b, labels=b).loss.item() > 0


def test_policy_and_reference_engines_dpo_style(torch_or_skip, tmp_path):
    """A short DPO-style loop: a LoRA policy and its frozen reference, two engines in one process,
    each on its own budgets; the policy's loss falls and the reference stays where it was."""
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    (tmp_path / "p").mkdir()
    (tmp_path / "r").mkdir()
    pcfg = ds_config(tmp_path / "p", "nvme", tiermem=TIGHT)
    pcfg["optimizer"]["params"]["lr"] = 1e-2
    rcfg = _forward_only_config(tmp_path / "r")
    rcfg["tiermem"] = {"host_budget_bytes": "2MiB", "device_budget_bytes": "512KiB"}
    with tt.zero.Init(config=pcfg):
        base = build("llama")
    policy, *_ = tt.initialize(model=_lora(base, "llama"), config=pcfg)
    ref_model = build("llama").eval()
    ref_model.requires_grad_(False)
    reference, *_ = tt.initialize(model=ref_model, config=rcfg)
    assert policy.stats()["host_budget_bytes"] != reference.stats()["host_budget_bytes"]
    g = torch.Generator().manual_seed(5)
    chosen = torch.randint(0, VOCAB, (2, 12), generator=g)
    rejected = torch.randint(0, VOCAB, (2, 12), generator=g)

    def logp(model, ids):
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)

    losses = []
    ref_scores = []
    for _ in range(6):
        with torch.no_grad():
            rc, rr = logp(reference, chosen), logp(reference, rejected)
        ref_scores.append((rc - rr).tolist())
        pc, pr = logp(policy, chosen), logp(policy, rejected)
        loss = -torch.nn.functional.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).mean()
        policy.backward(loss)
        policy.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert all(s == ref_scores[0] for s in ref_scores)  # the reference never changed
    policy.close()
    reference.close()


def test_peft_save_pretrained_loads_into_a_plain_model(torch_or_skip, tmp_path):
    torch = torch_or_skip
    hf_or_skip()
    peft = peft_or_skip()
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    cfg["optimizer"]["params"]["lr"] = 1e-2
    with tt.zero.Init(config=cfg):
        base = build("llama")
    model = _lora(base, "llama")
    engine, *_ = tt.initialize(model=model, config=cfg)
    engine_losses(engine, batches(3), 3)
    out = tmp_path / "adapter"
    model.save_pretrained(str(out))
    b = batches(4)[3]
    with torch.no_grad():
        want = engine(input_ids=b).logits.clone()
    engine.close()
    plain = peft.PeftModel.from_pretrained(build("llama"), str(out)).eval()
    with torch.no_grad():
        got = plain(input_ids=b).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    lora_b = [p for n, p in plain.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)  # the trained adapter, not its zero init
