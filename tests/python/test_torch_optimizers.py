"""optimizer.type Lion and Adagrad: the engine's SIMD kernels (tiermem/optim_kernels.h) stepping
each sub-group on its tier, against torch.optim.Adagrad and a Lion written out here (Chen et al.
2023), on a GPT-2 with everything on NVMe at tight budgets; an unknown type is refused naming the
supported ones, before anything is written."""

import os

import pytest
import torch
from torch_models import assert_rel_close, batches, build, ds_config, hf_or_skip

TIGHT = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}


def _reference(model, data, step_fn):
    model.train()
    out = []
    params = [p for p in model.parameters() if p.requires_grad]
    for i, b in enumerate(data):
        torch.manual_seed(100 + i)  # the same dropout masks as the engine's run
        loss = model(input_ids=b, labels=b).loss
        loss.backward()
        out.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        step_fn(params)
        for p in params:
            p.grad = None
    return out


def _engine_losses(engine, data):
    out = []
    for i, b in enumerate(data):
        torch.manual_seed(100 + i)
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def test_adagrad_equals_torch(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(8)
    ref = build("gpt2")
    opt = torch.optim.Adagrad([p for p in ref.parameters()], lr=1e-2, weight_decay=0.01, eps=1e-10,
                              initial_accumulator_value=0.1)
    want = _reference(ref, data, lambda ps: opt.step())
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    cfg["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                      "initial_accumulator_value": 0.1}}
    engine, *_ = tt.initialize(model=build("gpt2"), config=cfg)
    got = _engine_losses(engine, data)
    assert_rel_close(got, want, 1e-5)
    assert got[-1] < got[0]
    engine.close()


def test_lion_equals_a_written_out_lion(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(8)
    lr, b1, b2, wd = 1e-4, 0.9, 0.99, 0.1
    ref = build("gpt2")
    state = {}

    def lion(params):
        with torch.no_grad():
            for p in params:
                m = state.setdefault(p, torch.zeros_like(p))
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)

    want = _reference(ref, data, lion)
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    cfg["optimizer"] = {"type": "Lion", "params": {"lr": lr, "weight_decay": wd}}  # betas: Lion's defaults
    engine, *_ = tt.initialize(model=build("gpt2"), config=cfg)
    got = _engine_losses(engine, data)
    assert_rel_close(got, want, 1e-5)
    assert got[-1] < got[0]
    engine.close()


def test_unknown_optimizer_is_refused(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme", tiermem=TIGHT)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}
    with pytest.raises(ValueError, match='"lion", "adagrad"'):
        tt.initialize(model=build("gpt2"), config=cfg)
    assert os.listdir(tmp_path) == []
