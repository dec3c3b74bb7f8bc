"""ZeroOptimizer.state_dict() / load_state_dict(): the engine's whole optimizer state in torch's
layout, restored into a NEW engine so that training continues bit for bit.

For AdamW, Lion and Adagrad (and fp16 with a skipped step, whose loss-scaler state must carry
over), with parameters and optimizer state on NVMe at budgets that page every step: one engine
trains 8 steps; another trains 4, its state_dict() goes through torch.save / torch.load
(weights_only, as the HF Trainer loads it), a third engine built from the same initial model loads
it and trains the last 4 steps: its losses and final fp32 master weights equal the first's exactly.
Then the refusals: a dict that does not fit names the parameter (index and name) and the key and
changes nothing; a dict of hyper-parameters only (the old format) loads them with a warning."""

import pytest

from torch_models import batches, build, ds_config, hf_or_skip

_BUDGETS = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}
_OPTIMIZERS = {
    "AdamW": None,  # torch_models' default section
    "Lion": {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "Adagrad": {"type": "Adagrad", "params": {"lr": 1e-2, "weight_decay": 0.01, "initial_accumulator_value": 0.1}},
}
_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def _engine(tt, tmp_path, name: str, kind: str):
    (tmp_path / name).mkdir()
    cfg = ds_config(tmp_path / name, "nvme", tiermem=dict(_BUDGETS))
    if kind == "fp16":
        cfg["fp16"] = dict(_FP16)
    elif _OPTIMIZERS[kind] is not None:
        cfg["optimizer"] = _OPTIMIZERS[kind]
    model = build("gpt2", layers=1)
    return tt.initialize(model=model.half() if kind == "fp16" else model, config=cfg)[:2]


def _train(torch, engine, data, first: int):
    """engine.backward / engine.step over `data` (step `first` + i); step 1 of an fp16 run gets an
    infinite loss, so the engine skips it and lowers its loss scale."""
    out = []
    for i, b in enumerate(data):
        loss = engine(input_ids=b, labels=b).loss
        out.append(loss.item())
        engine.backward(loss * float("inf") if engine.fp16 and first + i == 1 else loss)
        engine.step()
    return out


@pytest.mark.parametrize("kind", ["AdamW", "Lion", "Adagrad", "fp16"])
def test_state_dict_resumes_bit_for_bit(torch_or_skip, tmp_path, kind):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    from tiermem.torch.utils import safe_get_full_fp32_param
    data = batches(8)
    whole, _ = _engine(tt, tmp_path, "whole", kind)
    want = _train(torch, whole, data, 0)

    first, opt = _engine(tt, tmp_path, "first", kind)
    _train(torch, first, data[:4], 0)
    sd = opt.state_dict()
    rng = torch.get_rng_state()  # dropout: the continuation draws what the whole run drew
    torch.save(sd, tmp_path / "optimizer.pt")
    first.close()
    trainable = [p for p in whole.module.parameters() if p.requires_grad]
    assert sorted(sd["state"]) == list(range(len(trainable)))
    keys = {"AdamW": {"exp_avg", "exp_avg_sq"}, "fp16": {"exp_avg", "exp_avg_sq"}, "Lion": {"exp_avg"},
            "Adagrad": {"sum"}}[kind]
    for i, p in enumerate(trainable):
        assert set(sd["state"][i]) == keys | {"master", "step"}
        assert all(sd["state"][i][k].shape == p.shape and sd["state"][i][k].dtype == torch.float32
                   for k in keys | {"master"})
    assert float(sd["state"][0]["step"]) == (3 if kind == "fp16" else 4)  # fp16: step 1 was skipped
    assert sd["tiermem"]["skipped_steps"] == (1 if kind == "fp16" else 0)

    resumed, opt2 = _engine(tt, tmp_path, "resumed", kind)
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert (resumed.global_steps, resumed.skipped_steps) == (first.global_steps, first.skipped_steps)
    if kind == "fp16":
        assert resumed._zero.loss_scale() == sd["tiermem"]["loss_scaler"]["loss_scale"]
    torch.set_rng_state(rng)
    got = _train(torch, resumed, data[4:], 4)
    assert got == want[4:], (got, want[4:])
    for p, q in zip(whole.module.parameters(), resumed.module.parameters()):
        assert torch.equal(safe_get_full_fp32_param(p), safe_get_full_fp32_param(q))
    whole.close()
    resumed.close()


def test_load_state_dict_refusals_change_nothing(torch_or_skip, tmp_path):
    torch = torch_or_skip
    hf_or_skip()
    import copy

    import tiermem.torch as tt
    from tiermem.torch.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    engine, opt = _engine(tt, tmp_path, "a", "AdamW")
    _train(torch, engine, batches(2), 0)
    sd = opt.state_dict()
    params = [p for p in engine.module.parameters() if p.requires_grad]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    before = (safe_get_full_fp32_param(params[3]), safe_get_full_optimizer_state(params[3], "exp_avg"))
    # A state that is not this one's: every value changed, so a partial write would show.
    other = copy.deepcopy(sd)
    for s in other["state"].values():
        for k in ("master", "exp_avg", "exp_avg_sq"):
            s[k] += 1.0

    def refused(mutate, *words):
        bad = copy.deepcopy(other)
        mutate(bad)
        with pytest.raises(ValueError) as e:
            opt.load_state_dict(bad)
        for w in words:
            assert w in str(e.value), str(e.value)

    last = len(params) - 1
    refused(lambda d: d["state"].pop(3), "parameter 3", names[id(params[3])], "no entry")
    refused(lambda d: d["state"][last].pop("exp_avg_sq"), f"parameter {last}", names[id(params[last])],
            "'exp_avg_sq'")
    refused(lambda d: d["state"][last].update(exp_avg=torch.zeros(3)), f"parameter {last}", "'exp_avg'",
            "shape (3,)")
    refused(lambda d: d["state"].update({len(params): d["state"][0]}), f"parameter {len(params)}")
    refused(lambda d: d["state"][2].update(step=torch.tensor(7.0)), "parameter 2", "'step' = 7")
    refused(lambda d: d["state"][2].update(step=torch.tensor(float("inf"))), "parameter 2", "not a step count")
    refused(lambda d: d["param_groups"].append(dict(d["param_groups"][0])), "2 groups")
    refused(lambda d: d["param_groups"][0]["params"].pop(), "param group 0")

    def as_lion(d):
        d["tiermem"]["optimizer_type"] = "lion"
        for s in d["state"].values():
            del s["exp_avg_sq"]
    refused(as_lion, "lion", "does not carry over")
    assert torch.equal(safe_get_full_fp32_param(params[3]), before[0])
    assert torch.equal(safe_get_full_optimizer_state(params[3], "exp_avg"), before[1])

    # The old format: hyper-parameters only. They load; a warning says the state did not.
    old = {"state": {}, "param_groups": copy.deepcopy(sd["param_groups"])}
    old["param_groups"][0]["lr"] = 0.5
    with pytest.warns(UserWarning, match="NOT restored"):
        opt.load_state_dict(old)
    assert opt.param_groups[0]["lr"] == 0.5
    assert torch.equal(safe_get_full_fp32_param(params[3]), before[0])
    engine.close()
