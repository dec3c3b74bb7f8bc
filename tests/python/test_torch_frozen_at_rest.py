"""A frozen base stored in fewer bytes (tiermem.frozen_dtype / zero_quantized_nontrainable_weights):
a 2-layer Llama (hidden 128) with PEFT LoRA on q/v, built under zero.Init, params and optimizer on
NVMe at budgets small enough that every step pages.

- For each format at rest (the working dtype, bf16, int8 per-128 absmax): the logits of the first
  batch within the tolerance docs/python.md states of the plain fp32-base PEFT model's (the working
  dtype: equal); the first step's loss within it too; four LoRA steps train (the loss falls); the
  host and device budgets hold; a load_state_dict of a frozen weight reads back within the
  format's bound; the stored frozen bytes are the format's (about 4, 2, 1.03 bytes
  an element); the `initialize` line names the format; save_fp32_model says the values it writes
  are dequantized.
- Bad input: bf16 at rest with an fp16 working dtype, and the two keys contradicting each other,
  are each a ValueError naming the key, before anything is written.
"""

import warnings

import pytest
from torch_models import batches, build, ds_config, hf_or_skip

TIGHT_128 = {"host_budget_bytes": "1MiB", "device_budget_bytes": "1MiB"}
# docs/python.md "Frozen base at rest": the largest |logit - fp32-base logit| allowed, as a share of
# the fp32-base logits' largest |value| (measured: bf16 0.35 %, int8 1.6 %), and the relative
# difference of the loss (measured: bf16 1.1e-5, int8 1.7e-4).
LOGIT_TOL = {"auto": 0.0, "bf16": 0.01, "int8": 0.04}
LOSS_TOL = {"auto": 0.0, "bf16": 1e-4, "int8": 1e-3}
BYTES_PER_ELEM = {"auto": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 128}


def _lora(model):
    try:
        import peft
    except Exception as e:  # not installed, or a broken install
        pytest.skip(f"peft cannot be imported: {e}")
    import torch
    torch.manual_seed(123)  # the adapters' init: the same in both builds
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("at_rest", ["auto", "bf16", "int8"])
def test_lora_base_at_rest_within_tolerance(torch_or_skip, tmp_path, capfd, at_rest):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(5)
    plain = _lora(build("llama", hidden=128))
    with torch.no_grad():
        want = plain(input_ids=data[0], labels=data[0])
    cfg = ds_config(tmp_path, "nvme", tiermem=dict(TIGHT_128))
    if at_rest == "int8":  # DeepSpeed's key says int8
        cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
    elif at_rest == "bf16":
        cfg["tiermem"]["frozen_dtype"] = "bf16"
    with tt.zero.Init(config=cfg):
        base = build("llama", hidden=128)
    model = _lora(base)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    engine, *_ = tt.initialize(model=model, config=cfg)
    banner = capfd.readouterr().err
    words = {"auto": "frozen base at rest: the working dtype", "bf16": "frozen base at rest: bf16",
             "int8": "frozen base at rest: int8 (per-128 absmax"}[at_rest]
    assert words in banner, banner
    st0 = engine.stats()
    assert st0["frozen_dtype"] == {"auto": "working"}.get(at_rest, at_rest)
    per_elem = st0["frozen_param_bytes"] / n_frozen
    assert BYTES_PER_ELEM[at_rest] <= per_elem < BYTES_PER_ELEM[at_rest] * 1.2, per_elem  # padding: < 20 %

    with torch.no_grad():
        got = engine(input_ids=data[0], labels=data[0])
    diff = (got.logits - want.logits).abs().max().item() / want.logits.abs().max().item()
    assert diff <= LOGIT_TOL[at_rest], (at_rest, diff)
    assert abs(got.loss.item() - want.loss.item()) <= LOSS_TOL[at_rest] * want.loss.item()

    losses = []
    for b in data[:4]:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = engine(input_ids=data[0], labels=data[0]).loss.item()
    assert after < losses[0], (losses, after)  # the adapters trained over the quantized base
    st = engine.stats()
    assert st["host_pool_peak_bytes"] <= st["host_budget_bytes"]
    assert st["device_peak_bytes"] <= st["device_budget_bytes"]
    assert st["nvme_written_frozen_bytes"] <= st0["frozen_param_bytes"] + 4096 * 64  # once, in the smaller format

    # A rewrite (load_state_dict's write-through) is quantized again: read back within the format's
    # bound (per element: half a bf16 ulp; int8: half the largest |value| / 127 of the tensor, which
    # bounds every group's), exact in the working dtype.
    name = next(n for n, p in model.named_parameters() if n.endswith("layers.0.mlp.up_proj.weight"))
    w = dict(model.named_parameters())[name]
    new = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 0.05
    model.load_state_dict({name: new}, strict=False)
    with tt.zero.GatheredParameters([w]):
        back = w.data.clone()
    bound = {"auto": torch.zeros_like(new), "bf16": new.abs() * 2.0 ** -8,
             "int8": torch.full_like(new, new.abs().max().item() / 254 * (1 + 1e-5))}[at_rest]
    assert ((back - new).abs() <= bound).all(), (at_rest, (back - new).abs().max().item())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_fp32_model(str(tmp_path / "model.pt"))
    said = [str(w.message) for w in caught if "dequantized" in str(w.message)]
    assert bool(said) == (at_rest != "auto"), said
    engine.close()


@pytest.mark.parametrize("setting, key", [
    ({"fp16": {"enabled": True}, "tiermem": {"frozen_dtype": "bf16"}}, "tiermem.frozen_dtype"),
    ({"zq": False, "tiermem": {"frozen_dtype": "int8"}}, "zero_quantized_nontrainable_weights"),
])
def test_bad_combination_is_refused(torch_or_skip, tmp_path, setting, key):
    hf_or_skip()
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme", tiermem=dict(TIGHT_128))
    for k, v in setting.items():
        if k == "zq":
            cfg["zero_optimization"]["zero_quantized_nontrainable_weights"] = v
        elif k == "tiermem":
            cfg["tiermem"].update(v)
        else:
            cfg[k] = v
    model = _lora(build("llama", hidden=128))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tt.initialize(model=model, config=cfg)
    assert not any(tmp_path.iterdir())  # refused before a swap file was made
