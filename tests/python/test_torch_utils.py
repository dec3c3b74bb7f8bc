"""tiermem.torch.utils: DeepSpeed's ZeRO-3 utility functions on engine-managed parameters, checked
against the same model trained by plain torch with torch.optim.AdamW: the fp32 parameter, the
gradient between backward and step, the Adam moments after a step; the setters round-trip; bad
input gets TypeError / ValueError / RuntimeError."""

import pytest
import torch
from torch_models import batches, build, ds_config, hf_or_skip


def test_safe_get_and_set_match_plain_torch(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    from tiermem.torch import utils
    b = batches(1)[0]
    plain = build("gpt2")
    model = build("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)  # one frozen parameter
    plain.transformer.wpe.weight.requires_grad_(False)
    cfg = ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    engine, *_ = tt.initialize(model=model, config=cfg)
    names = ["transformer.h.0.attn.c_attn.weight", "transformer.wte.weight", "transformer.ln_f.bias"]
    mp = dict(model.named_parameters())
    pp = dict(plain.named_parameters())
    for n in names:
        assert torch.equal(utils.safe_get_full_fp32_param(mp[n]), pp[n].detach())
    with pytest.raises(RuntimeError, match="between"):
        utils.safe_get_full_grad(mp[names[0]])  # no backward yet

    plain.train()
    torch.manual_seed(7)  # the same dropout masks in both
    loss_ref = plain(input_ids=b, labels=b).loss
    loss_ref.backward()
    torch.manual_seed(7)
    loss = engine(input_ids=b, labels=b).loss
    engine.backward(loss)
    for n in names:
        g = utils.safe_get_full_grad(mp[n])
        assert g.shape == pp[n].shape and g.dtype == torch.float32
        assert torch.allclose(g, pp[n].grad, rtol=1e-4, atol=1e-6), n
    assert utils.safe_get_full_grad(mp["transformer.wpe.weight"]) is None  # frozen: no gradient

    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.requires_grad], 1.0)
    opt.step()
    engine.step()
    with pytest.raises(RuntimeError, match="between"):
        utils.safe_get_full_grad(mp[names[0]])  # consumed by the step
    for n in names:
        for key in ("exp_avg", "exp_avg_sq"):
            got = utils.safe_get_full_optimizer_state(mp[n], key)
            want = opt.state[pp[n]][key]
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-9), (n, key)
        assert torch.allclose(utils.safe_get_full_fp32_param(mp[n]), pp[n].detach(), rtol=1e-5, atol=1e-7)
    assert utils.safe_get_full_optimizer_state(mp["transformer.wpe.weight"], "exp_avg") is None

    # Setters: what is set is what is read back, and the model computes with it.
    w = mp[names[0]]
    new = torch.full(w.shape, 0.125)
    utils.safe_set_full_fp32_param(w, new)
    assert torch.equal(utils.safe_get_full_fp32_param(w), new)
    with tt.zero.GatheredParameters([w]):
        assert torch.equal(w.data, new)
    m = torch.full(w.shape, 0.5)
    utils.safe_set_full_optimizer_state(w, m, "exp_avg")
    assert torch.equal(utils.safe_get_full_optimizer_state(w, "exp_avg"), m)

    # Bad input.
    with pytest.raises(TypeError, match="not managed"):
        utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="optim_state_key"):
        utils.safe_get_full_optimizer_state(w, "momentum")
    with pytest.raises(ValueError, match="shape"):
        utils.safe_set_full_fp32_param(w, torch.zeros(3))
    with pytest.raises(ValueError, match="frozen"):
        utils.safe_set_full_optimizer_state(mp["transformer.wpe.weight"], torch.zeros(mp["transformer.wpe.weight"].shape),
                                            "exp_avg")
    engine.close()
    with pytest.raises(TypeError, match="not managed"):
        utils.safe_get_full_fp32_param(w)
