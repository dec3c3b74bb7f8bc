"""tiermem.torch.NVMeAdamW: AdamW with its state in tiermem's NVMe swap space.

Against torch.optim.AdamW (same tolerance as CPUAdamW), bit for bit against CPUAdamW (the same
kernel, so the swap space must return every byte), resume through state_dict bit for bit, half
parameters with their fp32 master on NVMe, parameters without gradients, and the errors."""

import copy
import os

import pytest

from test_cpu_adam import scale_close, tiny_model, train


def nvme(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return str(d)


@pytest.mark.parametrize("sub_group_size", [1000, 1 << 24])
def test_matches_torch_adamw_and_cpu_adamw(torch_or_skip, tmp_path, sub_group_size):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW, NVMeAdamW
    a, b, c = tiny_model(torch), tiny_model(torch), tiny_model(torch)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.05)
    cpu = CPUAdamW(b.parameters(), lr=1e-2, weight_decay=0.05)
    opt = NVMeAdamW(c.parameters(), lr=1e-2, weight_decay=0.05, nvme_path=nvme(tmp_path, "n"),
                    sub_group_size=sub_group_size)
    # 1000 elements: 2664 parameters in 3 sub-groups, the first weight split over two of them.
    assert len(opt._sub_groups) == (3 if sub_group_size == 1000 else 1)
    train(torch, a, ref)
    train(torch, b, cpu)
    losses = train(torch, c, opt)
    assert losses[-1] < losses[0]
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        scale_close(torch, pc, pa, rel=1e-5)
        assert torch.equal(pc, pb)
    # The moments are on NVMe, not in host memory, and equal CPUAdamW's bit for bit.
    sd = opt.state_dict()
    for i, p in enumerate(b.parameters()):
        assert set(opt.state[list(c.parameters())[i]].keys()) == {"step"}
        assert torch.equal(sd["state"][i]["exp_avg"], cpu.state[p]["exp_avg"])
        assert torch.equal(sd["state"][i]["exp_avg_sq"], cpu.state[p]["exp_avg_sq"])
    stats = opt.swap_stats()
    assert stats["bytes_written"] >= 50 * 2 * 4 * 2664
    assert opt.nvme_bytes >= 2 * 4 * 2664 and stats["extents"] == len(opt._sub_groups)


def test_state_dict_resume_is_bitwise(torch_or_skip, tmp_path):
    torch = torch_or_skip
    from tiermem.torch import NVMeAdamW
    a = tiny_model(torch)
    opt_a = NVMeAdamW(a.parameters(), lr=1e-2, nvme_path=nvme(tmp_path, "a"), sub_group_size=700)
    train(torch, a, opt_a, steps=30)
    saved_model = copy.deepcopy(a.state_dict())
    saved_opt = copy.deepcopy(opt_a.state_dict())
    train(torch, a, opt_a, steps=20, seed=7)

    b = tiny_model(torch)
    b.load_state_dict(saved_model)
    opt_b = NVMeAdamW(b.parameters(), lr=5.0, nvme_path=nvme(tmp_path, "b"), sub_group_size=700)
    opt_b.load_state_dict(saved_opt)
    assert opt_b.param_groups[0]["lr"] == 1e-2  # hyper-parameters come from the state dict
    train(torch, b, opt_b, steps=20, seed=7)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for i in sa["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][i][key], sb["state"][i][key])


def test_loads_torch_adamw_state(torch_or_skip, tmp_path):
    torch = torch_or_skip
    from tiermem.torch import NVMeAdamW
    a = tiny_model(torch)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train(torch, a, ref, steps=10)
    b = copy.deepcopy(a)
    opt = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=nvme(tmp_path, "n"), sub_group_size=900)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(torch, a, ref, steps=10, seed=3)
    train(torch, b, opt, steps=10, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        scale_close(torch, pb, pa, rel=1e-5)


def test_half_parameters_keep_fp32_master_on_nvme(torch_or_skip, tmp_path):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW, NVMeAdamW
    torch.manual_seed(0)
    master = [torch.randn(300, 7).to(torch.bfloat16).float(), torch.randn(1000).to(torch.bfloat16).float()]
    halves = [m.to(torch.bfloat16).requires_grad_() for m in master]
    ref_master = [m.clone().requires_grad_() for m in master]
    ref_half = [torch.empty(m.shape, dtype=torch.bfloat16) for m in master]
    opt = NVMeAdamW(halves, lr=1e-2, weight_decay=0.1, nvme_path=nvme(tmp_path, "n"), sub_group_size=1500)
    ref = CPUAdamW(ref_master, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        for h, m in zip(halves, ref_master):
            grad = torch.randn(h.shape, generator=g).to(torch.bfloat16)
            h.grad = grad
            m.grad = grad.float()
        opt.step()
        ref.step(fp16_param_groups=[ref_half])
    for h, rh, m in zip(halves, ref_half, ref_master):
        assert torch.equal(h, rh)  # the model's bf16 weights: the rounded fp32 master
    sd = opt.state_dict()
    for i, m in enumerate(ref_master):
        assert torch.equal(sd["state"][i]["master"], m.detach())
    assert opt.nvme_bytes >= 3 * 4 * 3100  # master + two moments


def test_parameters_without_gradients_are_skipped(torch_or_skip, tmp_path):
    torch = torch_or_skip
    from tiermem.torch import NVMeAdamW
    a, b = tiny_model(torch), tiny_model(torch)
    for m in (a, b):
        m[0].weight.requires_grad_(False)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt = NVMeAdamW(b.parameters(), lr=1e-2, nvme_path=nvme(tmp_path, "n"), sub_group_size=1000)
    train(torch, a, ref, steps=10)
    train(torch, b, opt, steps=10)
    assert torch.equal(b[0].weight, tiny_model(torch)[0].weight)  # untouched
    assert "step" not in opt.state[b[0].weight]
    for pa, pb in zip(a.parameters(), b.parameters()):
        scale_close(torch, pb, pa, rel=1e-5)


def test_errors(torch_or_skip, tmp_path):
    torch = torch_or_skip
    from tiermem.torch import NVMeAdamW
    p = torch.zeros(10, requires_grad=True)
    d = nvme(tmp_path, "n")
    with pytest.raises(ValueError, match="buffer_count"):
        NVMeAdamW([p], nvme_path=d, buffer_count=2)
    with pytest.raises(ValueError, match="sub_group_size"):
        NVMeAdamW([p], nvme_path=d, sub_group_size=0)
    with pytest.raises(ValueError, match="nvme_path"):
        NVMeAdamW([p], nvme_path=[])
    with pytest.raises(ValueError, match="dtype torch.int64"):
        NVMeAdamW([torch.zeros(10, dtype=torch.int64)], nvme_path=d)
    first = NVMeAdamW([p], nvme_path=d)
    with pytest.raises(RuntimeError, match="tiermem.lock|locked|pid"):
        NVMeAdamW([p], nvme_path=d)  # one swap space per directory
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.step()
    NVMeAdamW([p], nvme_path=d)  # the directory is free again
    with pytest.raises(TypeError, match="load_state_dict: expected a dict with 'state'"):
        NVMeAdamW([p], nvme_path=nvme(tmp_path, "sd")).load_state_dict("garbage")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile.*is a file"):
        NVMeAdamW([p], nvme_path=str(tmp_path / "afile"))
    with pytest.raises(ValueError, match="lists one directory twice"):  # was "in use by another engine"
        NVMeAdamW([p], nvme_path=[d, d + "/."])


def test_what_the_layout_cannot_follow_is_refused(torch_or_skip, tmp_path):
    """The sub-groups on NVMe are laid out when the optimizer is built: a param group added later
    was accepted and never stepped, and a parameter resized later was stepped over its old length
    only (its other elements silently left as they were)."""
    torch = torch_or_skip
    from tiermem.torch import NVMeAdamW
    p = torch.nn.Parameter(torch.zeros(5))
    opt = NVMeAdamW([p], nvme_path=nvme(tmp_path, "n"))
    with pytest.raises(NotImplementedError, match="give every param group to NVMeAdamW"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1})
    assert len(opt.param_groups) == 1
    p.data = torch.zeros(50)
    p.grad = torch.ones(50)
    with pytest.raises(ValueError, match=r"params'\]\[0\] has 50 elements .* had 5 when the optimizer was built"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(50)) and "step" not in opt.state[p]  # nothing changed
    opt.close()
    # A dtype changed since stepped the parameters before it, then failed on a None master.
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = NVMeAdamW([a, b], nvme_path=nvme(tmp_path, "d"))
    b.data = b.data.to(torch.bfloat16)
    a.grad, b.grad = torch.ones(4), torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"params'\]\[1\] is torch.bfloat16 but was torch.float32"):
        opt.step()
    assert torch.equal(a.detach(), torch.zeros(4)) and not opt.state[a]  # nothing stepped
    opt.close()


def test_directories_it_made_go_with_it(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import gc
    from tiermem.torch import NVMeAdamW
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.ones(10)
    made = tmp_path / "new" / "deep"
    opt = NVMeAdamW([p], nvme_path=str(made))
    opt.step()
    assert made.is_dir()
    opt.close()
    del opt
    gc.collect()
    assert not (tmp_path / "new").exists()  # both levels it made, gone
    kept = tmp_path / "mine"
    kept.mkdir()
    opt = NVMeAdamW([p], nvme_path=str(kept))
    opt.step()
    del opt
    gc.collect()
    assert kept.is_dir() and os.listdir(kept) == []  # the user's directory stays, emptied
