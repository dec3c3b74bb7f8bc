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
    first, second = engine(input_ids=b, labels=b).loss, engine(input_ids=b, labels=b).loss  # two losses
    engine.backward(first)
    with pytest.raises(RuntimeError, match="second backward"):
        engine.backward(second)
    with pytest.raises(RuntimeError, match="step\\(\\) has not run"):  # nor a forward: it would mix steps
        engine(input_ids=b, labels=b)
    engine.step()  # the step still finishes
    assert engine.global_steps == 1
    engine.backward(engine(input_ids=b, labels=b).loss)
    engine.step()
    assert engine.global_steps == 2
    engine.close()


def _engine(tmp_path, name="e", **tiermem):
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / name, "nvme", clip=0.0,
                    tiermem={"host_budget_bytes": "4MiB", "device_budget_bytes": "2MiB", **tiermem})
    engine, optimizer, *_ = tt.initialize(model=build("gpt2"), config=cfg)
    return engine, optimizer


def test_the_optimizer_stepped_directly_after_engine_backward(torch_or_skip, tmp_path):
    """engine.backward(loss) then the returned optimizer's step() (no engine.step()): each step's
    updates still run in backward, the same losses as with the setting off."""
    hf_or_skip()
    losses = {}
    for on in (False, True):
        engine, opt = _engine(tmp_path, str(on), update_in_backward=on)
        got = []
        for b in batches(3):
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            got.append(loss.item())
        losses[on] = got
        assert (engine.stats()["updates_in_backward"] > 0) == on
        engine.close()
    assert losses[True] == losses[False]


def _loss_failing_in_backward(torch, engine, b, at_first_block: bool):
    """GPT-2's loss on batch `b` whose backward raises ValueError("boom in backward"): at the first
    block's output (after the later blocks' units were updated in it, with the setting on), or
    at the loss itself (before any unit's gradient)."""

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom in backward")

    if not at_first_block:
        return Boom.apply(engine(input_ids=b, labels=b).loss)

    def through_boom(module, inputs, out):
        return Boom.apply(out) if isinstance(out, torch.Tensor) else (Boom.apply(out[0]),) + tuple(out[1:])

    hook = engine.module.transformer.h[0].register_forward_hook(through_boom)
    try:
        return engine(input_ids=b, labels=b).loss
    finally:
        hook.remove()


@pytest.mark.parametrize("on", [False, True])
def test_a_backward_that_raises_leaves_training_usable(torch_or_skip, tmp_path, on):
    """A backward that raises midway (at the boundary; with the setting on, after some units were
    updated in it): the engine refuses what would mix the half-done step, step() finishes it, and
    training goes on with every later backward counted (before, the end of the failed backward
    stayed pending and no later backward counted: every step() was refused)."""
    hf_or_skip()
    torch = torch_or_skip
    engine, _ = _engine(tmp_path, update_in_backward=on)
    b = batches(1)[0]
    loss = _loss_failing_in_backward(torch, engine, b, at_first_block=True)
    with pytest.raises(ValueError, match="boom"):
        engine.backward(loss)
    assert (engine.stats()["updates_in_backward"] > 0) == on
    if on:
        with pytest.raises(RuntimeError, match="call step"):
            engine.zero_grad()
    engine.step()
    for _ in range(3):
        engine.backward(engine(input_ids=b, labels=b).loss)
        engine.step()
    assert engine.global_steps == 4
    engine.close()


def test_reads_and_writes_of_a_half_done_step_are_refused(torch_or_skip, tmp_path):
    """Between the boundary's backward and step(), some units already hold the new step: reading
    the model (master weights, an evaluation forward, a checkpoint) or writing it is refused,
    nothing changes, and after step() all of it works."""
    hf_or_skip()
    torch = torch_or_skip
    import tiermem.torch as tt
    engine, _ = _engine(tmp_path, update_in_backward=True)
    b = batches(1)[0]
    engine.backward(engine(input_ids=b, labels=b).loss)
    assert engine.stats()["updates_in_backward"] > 0
    with pytest.raises(RuntimeError, match="step\\(\\) has not run"):
        engine.master_weights(0)
    with pytest.raises(RuntimeError, match="step\\(\\) has not run"):
        with torch.no_grad():
            engine(input_ids=b, labels=b)
    with pytest.raises(RuntimeError, match="step\\(\\) has not run"):
        engine.save_checkpoint(str(tmp_path / "ck"))
    p = next(engine.module.parameters())
    with pytest.raises(RuntimeError, match="step\\(\\) has not run"):
        tt.utils.safe_set_full_fp32_param(p, torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape))
    engine.step()
    engine.master_weights(0)
    engine.save_checkpoint(str(tmp_path / "ck"))
    with torch.no_grad():
        engine(input_ids=b, labels=b)
    engine.close()


def test_loss_backward_directly_is_told_the_setting_does_not_apply(torch_or_skip, tmp_path):
    hf_or_skip()
    engine, opt = _engine(tmp_path, update_in_backward=True)
    b = batches(1)[0]
    engine(input_ids=b, labels=b).loss.backward()
    with pytest.warns(UserWarning, match="did not run through engine.backward") as caught:
        opt.step()
    assert caught[0].filename == __file__  # the user's line, not torch's wrappers
    assert engine.stats()["updates_in_backward"] == 0
    engine.close()


@pytest.mark.parametrize("where", ["before any update", "after some updates"])
def test_training_goes_on_after_a_failed_boundary_backward(torch_or_skip, tmp_path, where):
    """A boundary backward that raises: before any unit was updated, zero_grad() and a new backward
    are accepted (nothing is half done); after some were, step() finishes the step first. Either
    way the next backward and steps run."""
    hf_or_skip()
    torch = torch_or_skip
    engine, _ = _engine(tmp_path, update_in_backward=True)
    b = batches(1)[0]
    loss = _loss_failing_in_backward(torch, engine, b, at_first_block=where == "after some updates")
    with pytest.raises(ValueError, match="boom"):
        engine.backward(loss)
    if where == "before any update":
        assert engine._zero.updated_in_backward() == 0
        engine.zero_grad()
    else:
        assert engine._zero.updated_in_backward() > 0
        engine.step()
    for _ in range(2):
        engine.backward(engine(input_ids=b, labels=b).loss)
        engine.step()
    assert engine.global_steps == (2 if where == "before any update" else 3)
    engine.close()


def test_a_refused_forward_changes_nothing(torch_or_skip, tmp_path):
    """A forward refused between the boundary's backward and step() (its first unit's gather
    raises inside a pre-forward hook): training after it is bit for bit the run without it. Before,
    the hooks' cleanup ran twice (the pre-hook's and the always-called post hook's), the units'
    counts went wrong and later steps computed on stale gathers."""
    hf_or_skip()
    runs = []
    for refuse in (False, True):
        engine, _ = _engine(tmp_path, str(refuse), update_in_backward=True)
        data = batches(5)
        losses = []
        for i, b in enumerate(data[:4]):
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            if refuse and i == 1:
                with pytest.raises(RuntimeError, match="step\\(\\) has not run"):
                    engine(input_ids=data[4], labels=data[4])
                assert engine._hooks.depth == 0
                assert all(u.active == 0 for u in engine._hooks.units.units)
            engine.step()
            losses.append(loss.item())
        runs.append(losses)
        engine.close()
    assert runs[0] == runs[1]
