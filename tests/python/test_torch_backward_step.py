"""tiermem.update_in_backward through tiermem.torch: with no gradient clipping, engine.backward at
the accumulation boundary declares the step (ZeroEngine.step_in_backward) and each unit's update
runs during backward once its gradient is complete. HF GPT-2 and Llama from small configs, params
and optimizer state paged through NVMe: every loss and every final master weight is bit for bit
the run with the setting off (updates deferred to the next forward), and within 1e-5 of
torch.optim.AdamW on the plain model; a second backward at the boundary is refused before it runs."""

import pytest

from torch_models import (assert_rel_close, batches, build, ds_config, engine_losses, hf_or_skip,
                          reference_losses)

STEPS = 6


def _train(tmp_path, kind, gas, on):
    import tiermem.torch as tt
    model = build(kind)
    tiermem = {"host_budget_bytes": "4MiB", "device_budget_bytes": "2MiB", "update_in_backward": on}
    engine, *_ = tt.initialize(model=model, config=ds_config(tmp_path / str(on), "nvme", gas=gas, clip=0.0,
                                                             tiermem=tiermem))
    losses = engine_losses(engine, batches(STEPS * gas), STEPS, gas=gas)
    masters = [engine.master_weights(u) for u in range(len(engine._hooks.units.units))]
    st = engine.stats()
    engine.close()
    return losses, masters, st


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("gas", [1, 2])
def test_updates_in_backward_change_nothing(torch_or_skip, tmp_path, kind, gas):
    hf_or_skip()
    torch = torch_or_skip
    off_losses, off_masters, off_st = _train(tmp_path, kind, gas, False)
    on_losses, on_masters, on_st = _train(tmp_path, kind, gas, True)
    assert on_losses == off_losses
    assert len(on_masters) == len(off_masters)
    for u, (a, b) in enumerate(zip(on_masters, off_masters)):
        assert torch.equal(a, b), f"unit {u}"
    assert off_st["updates_in_backward"] == 0
    # Most units' updates ran in backward: all but those whose gradient completes last.
    assert on_st["updates_in_backward"] >= STEPS * (len(on_masters) // 2), on_st["updates_in_backward"]
    want = reference_losses(build(kind), batches(STEPS * gas), STEPS, gas=gas, clip=0.0)
    assert_rel_close(on_losses, want, 1e-5)


def test_a_second_backward_at_the_boundary_is_refused(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    engine, *_ = tt.initialize(model=build("gpt2"), config=ds_config(tmp_path, "nvme", clip=0.0,
                                                                  tiermem={"update_in_backward": True}))
    b = batches(1)[0]
    engine.backward(engine(input_ids=b, labels=b).loss)
    with pytest.raises(RuntimeError, match="second backward"):
        engine.backward(engine(input_ids=b, labels=b).loss)
    engine.step()  # the step still finishes
    assert engine.global_steps == 1
    engine.backward(engine(input_ids=b, labels=b).loss)
    engine.step()
    assert engine.global_steps == 2
    engine.close()
