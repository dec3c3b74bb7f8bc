"""fp16 through tiermem.torch: the config's ``fp16`` section (dynamic and static loss scaling),
against a plain-PyTorch mixed-precision loop with DeepSpeed's loss-scaler rules.

The reference: the HF model in fp16 with fp32 master copies. Each step scales the loss by the
current scale before backward, copies the fp16 gradients to the masters, and checks them: a
non-finite gradient skips the step (masters, moments and the AdamW step count unchanged) and,
dynamic, halves the scale once hysteresis is spent (DeepSpeed's DynamicLossScaler with
consecutive_hysteresis false); otherwise the gradients are divided by the scale, clipped to norm
1.0, stepped by torch.optim.AdamW and rounded back into the fp16 model, and the scale doubles every
loss_scale_window steps since the last overflow. One step's loss is multiplied by inf before
backward, so its gradients are inf/NaN: that step must be skipped by both.

Checked: the engine's scale before every step equals the reference's exactly, it skips exactly the
poisoned step (skipped_steps 1, global_steps STEPS - 1), and its losses stay within 1e-3 relative of
the reference's over 10 steps (measured: 1.1e-5 at most; fp16 rounds the working weights and the
forward the same way in both, the engine's AdamW and torch's differ only in FMA rounding of the fp32
masters, which fp16's rounding mostly hides)."""

import math

import pytest

from torch_models import batches, build, ds_config, hf_or_skip

STEPS = 10
POISONED = 4  # 0-based step whose loss is multiplied by inf


class _Scaler:
    """DeepSpeed's loss-scaler rules, written out for the reference loop."""

    def __init__(self, fp16: dict) -> None:
        self.dynamic = fp16.get("loss_scale", 0) == 0
        self.scale = float(fp16["loss_scale"]) if not self.dynamic else 2.0 ** fp16["initial_scale_power"]
        self.window = fp16["loss_scale_window"]
        self.hysteresis = fp16["hysteresis"]
        self.left = self.hysteresis
        self.iter = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            if overflow:
                if self.left <= 1:
                    self.scale = max(self.scale / 2, 1.0)
                else:
                    self.left -= 1
                self.last_overflow = self.iter
            elif (self.iter - self.last_overflow) % self.window == 0:
                self.left = self.hysteresis
                self.scale *= 2
        self.iter += 1


def _poison(loss, step: int):
    return loss * math.inf if step == POISONED else loss


def _reference(torch, data, fp16: dict):
    model = build("gpt2").half()
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    scaler = _Scaler(fp16)
    losses, scales = [], []
    for i, b in enumerate(data):
        scales.append(scaler.scale)
        loss = model(input_ids=b, labels=b).loss
        (_poison(loss, i) * scaler.scale).backward()
        losses.append(loss.item())
        grads = [p.grad.float() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        overflow = not all(torch.isfinite(g).all() for g in grads)
        used = scaler.scale
        scaler.update(overflow)
        if overflow:
            continue
        for mp, g in zip(masters, grads):
            mp.grad = g / used
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, mp in zip(model.parameters(), masters):
                p.copy_(mp.half())
    return losses, scales


@pytest.mark.parametrize("fp16", [
    # dynamic, hysteresis 1: the overflow halves the scale at once; the window doubles it back
    {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1},
    # dynamic with DeepSpeed's default hysteresis 2: the first overflow only spends hysteresis
    {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 2},
    # static: the step is skipped, the scale stays
    {"enabled": True, "loss_scale": 128, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2},
], ids=["dynamic", "dynamic-hysteresis2", "static"])
def test_fp16_loss_scaling_matches_a_mixed_precision_reference(torch_or_skip, tmp_path, fp16):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(STEPS)
    want, want_scales = _reference(torch, data, fp16)

    model = build("gpt2")
    cfg = ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    cfg["fp16"] = dict(fp16)
    engine, *_ = tt.initialize(model=model, config=cfg)
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.float16  # the working dtype
    got, scales = [], []
    for i, b in enumerate(data):
        scales.append(engine._zero.loss_scale())
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(_poison(loss, i))
        engine.step()
        got.append(loss.item())
    assert scales == want_scales
    before, after = scales[POISONED], scales[POISONED + 1]
    if fp16["loss_scale"]:
        assert before == after == fp16["loss_scale"]
    elif fp16["hysteresis"] == 1:
        assert after == before / 2
    else:
        assert after == before  # hysteresis spent, scale kept
    assert engine.skipped_steps == 1 and engine.global_steps == STEPS - 1
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"fp16 {fp16}: scales {scales}, worst relative loss difference {worst:.3g}")
    assert worst <= 1e-3, (got, want)
    engine.close()
