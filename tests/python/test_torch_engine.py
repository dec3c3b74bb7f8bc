"""tiermem.torch.initialize against plain PyTorch: HF GPT-2 and Llama from small configs, fp32,
20 steps on fixed token batches; at every step the loss equals torch.optim.AdamW's on the plain
model within 1e-5 relative (the engine's AdamW is the same formula; only the summation order of
the clipping norm and FMA rounding differ). Stage 3 with offload none, cpu and nvme, gradient
accumulation 1 and 4, clipping on."""

import pytest

from torch_models import (assert_rel_close, batches, build, ds_config, engine_losses, hf_or_skip,
                          reference_losses)

STEPS = 20


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("offload,gas", [("none", 1), ("cpu", 4), ("nvme", 1), ("nvme", 4)])
def test_losses_equal_plain_pytorch(torch_or_skip, tmp_path, kind, offload, gas):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(STEPS * gas)
    want = reference_losses(build(kind), data, STEPS, gas=gas, clip=1.0)
    model = build(kind)
    extra = {}
    if offload == "nvme":  # budgets far below the state (1.9 MiB), so every step pages through NVMe
        extra["tiermem"] = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}
    engine, optimizer, _, _ = tt.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(tmp_path, offload, gas=gas, clip=1.0, **extra))
    got = engine_losses(engine, data, STEPS, gas=gas)
    assert_rel_close(got, want, 1e-5)
    assert engine.global_steps == STEPS
    st = engine.stats()
    if offload == "nvme":
        assert st["param_home"] == "nvme" and st["optimizer_home"] == "nvme"
        assert st["nvme_read_bytes"] > 0 and st["nvme_written_bytes"] > 0
    engine.close()
