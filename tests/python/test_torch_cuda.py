"""tiermem.torch with a model on CUDA: each gathered unit is copied from the engine's host memory
to the model's device, and gradients are copied back out (see tiermem/torch/_unit.py, "CUDA").
No GPU exists on the machines that run this suite, so the copy path is also run on the CPU
(``copy_in``: the CUDA path's CPU twin) and must give the same losses bit for bit as the
zero-copy CPU path. The test on a real CUDA device skips, saying so, when there is none."""

import pytest

from torch_models import (assert_rel_close, batches, build, ds_config, engine_losses, hf_or_skip,
                          reference_losses)

STEPS = 6


def _nvme_cfg(tmp_path, **kw):
    return ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}, **kw)


def _train(tt, kind, cfg, data, copy_in, gas=1):
    model = build(kind)
    engine, *_ = tt.initialize(model=model, config=cfg)
    link = engine._hooks.link  # what the model's units share: where they compute, and how
    link.copy_in = copy_in
    copies = []
    to_compute = link.to_compute

    def watched(flat, copy=False):
        out = to_compute(flat, copy)
        copies.append(out.data_ptr() != flat.data_ptr())
        return out

    link.to_compute = watched
    losses = engine_losses(engine, data, STEPS, gas)
    engine.close()
    return losses, copies


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_copy_path_equals_zero_copy_path(torch_or_skip, tmp_path, kind):
    hf_or_skip()
    import tiermem.torch as tt
    gas = 2
    data = batches(STEPS * gas)
    want = reference_losses(build(kind), data, STEPS, gas)
    direct, direct_copies = _train(tt, kind, _nvme_cfg(tmp_path / "a", gradient_accumulation_steps=gas), data,
                                   False, gas)
    copied, copied_copies = _train(tt, kind, _nvme_cfg(tmp_path / "b", gradient_accumulation_steps=gas), data,
                                   True, gas)
    # The zero-copy path views the engine's memory; the copy path copies every gathered unit
    # (forward and the backward's re-gathers).
    assert direct_copies and not any(direct_copies)
    assert copied_copies and all(copied_copies)
    assert len(copied_copies) == len(direct_copies)
    assert copied == direct  # the same arithmetic on the same values: bit for bit
    assert_rel_close(copied, want, 1e-5)


def test_model_on_cuda_matches_plain_torch(torch_or_skip, tmp_path):
    torch = torch_or_skip
    hf_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False): the CUDA path ran only as its CPU twin, "
                    "test_copy_path_equals_zero_copy_path")
    import tiermem.torch as tt
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data = [b.cuda() for b in batches(STEPS)]
    want = reference_losses(build("gpt2").cuda(), data, STEPS)
    model = build("gpt2").cuda()
    engine, *_ = tt.initialize(model=model, config=_nvme_cfg(tmp_path))
    assert engine._hooks.link.compute_device.type == "cuda"
    got = engine_losses(engine, data, STEPS)
    assert all(p.device.type == "cuda" for p in model.parameters())
    engine.close()
    # GPU reductions are not ordered as the CPU's: a looser bound than the CPU tests' 1e-5.
    assert_rel_close(got, want, 1e-4)


def test_model_on_unsupported_device_is_refused(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to("meta")
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight' is on meta.*model.to\('cpu'\)"):
        tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())
