"""tiermem.torch.CPUAdamW against torch.optim.AdamW / torch.optim.Adam.

Tolerance: on float32, after 50 steps every tensor (parameters, exp_avg, exp_avg_sq) is within
1e-6 x max|reference| of torch's (relative to the tensor's scale: elements near zero differ by a
few ulp of the update, FMA rounding, which is not small *relative to themselves*)."""

import copy

import pytest


def scale_close(torch, got, ref, rel=1e-6):
    diff = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3e} > {rel:g} x max |ref| {scale:.3e}"


def same_grads(torch, opt_ref, opt, p_ref, p, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grad = torch.randn(p.shape, generator=g)
        p_ref.grad = grad.clone()
        p.grad = grad.clone()
        opt_ref.step()
        opt.step()


def tiny_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def train(torch, model, opt, steps=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("wd", [0.0, 0.01, 0.1])
def test_matches_torch_adamw_same_gradients(torch_or_skip, wd):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    p0 = torch.randn(100_003)
    pr, pt = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    ref = torch.optim.AdamW([pr], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=False)
    opt = CPUAdamW([pt], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    same_grads(torch, ref, opt, pr, pt, 50)
    scale_close(torch, pt, pr)
    for key in ("exp_avg", "exp_avg_sq"):
        scale_close(torch, opt.state[pt][key], ref.state[pr][key])
    assert opt.state[pt]["step"].item() == 50


def test_trains_like_torch_adamw(torch_or_skip):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    a, b = tiny_model(torch), tiny_model(torch)
    la = train(torch, a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.05))
    lb = train(torch, b, CPUAdamW(b.parameters(), lr=1e-2, weight_decay=0.05))
    assert lb[-1] < lb[0]  # it learns
    for pa, pb in zip(a.parameters(), b.parameters()):
        scale_close(torch, pb, pa, rel=1e-5)  # 50 steps of feedback through the model
    assert abs(la[-1] - lb[-1]) <= 1e-5 * abs(la[-1])


def test_adam_mode_is_torch_adam_with_l2(torch_or_skip):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    p0 = torch.randn(4099)
    pr, pt = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    ref = torch.optim.Adam([pr], lr=1e-3, weight_decay=0.1, foreach=False)
    opt = CPUAdamW([pt], lr=1e-3, weight_decay=0.1, adamw_mode=False)
    same_grads(torch, ref, opt, pr, pt, 50)
    scale_close(torch, pt, pr)


def test_no_bias_correction_matches_the_formula(torch_or_skip):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    p = torch.randn(1000, dtype=torch.float64)
    pt = p.float().clone().requires_grad_()
    opt = CPUAdamW([pt], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0, bias_correction=False)
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        grad = torch.randn(1000, generator=g, dtype=torch.float64)
        pt.grad = grad.float()
        opt.step()
        m = 0.8 * m + 0.2 * grad
        v = 0.9 * v + 0.1 * grad * grad
        p = p - 1e-2 * m / (v.sqrt() + 1e-6)
    scale_close(torch, pt, p, rel=1e-5)  # fp32 kernel vs a float64 evaluation


@pytest.mark.parametrize("half_name", ["bfloat16", "float16"])
def test_fused_half_copy_is_the_rounded_parameter(torch_or_skip, half_name):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    half = getattr(torch, half_name)
    model = tiny_model(torch)
    opt = CPUAdamW(model.parameters(), lr=1e-2)
    copies = [[torch.empty(p.shape, dtype=half) for p in model.parameters()]]
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step(fp16_param_groups=copies)
    for p, c in zip(model.parameters(), copies[0]):
        assert torch.equal(c, p.detach().to(half))  # round to nearest even, bit for bit


def test_state_dict_moves_between_torch_and_tiermem(torch_or_skip):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    a = tiny_model(torch)
    opt = CPUAdamW(a.parameters(), lr=1e-2)
    train(torch, a, opt, steps=10)
    b = copy.deepcopy(a)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(torch, a, opt, steps=10, seed=9)
    train(torch, b, ref, steps=10, seed=9)
    for pa, pb in zip(a.parameters(), b.parameters()):
        scale_close(torch, pa, pb, rel=1e-5)


def test_bad_arguments(torch_or_skip):
    torch = torch_or_skip
    from tiermem.torch import CPUAdamW
    p = torch.zeros(10, requires_grad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        CPUAdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="lr"):
        CPUAdamW([p], lr=-1.0)
    # A parameter the kernel cannot step is refused when it is given, not at the first step().
    for bad in (torch.zeros(10, dtype=torch.float16, requires_grad=True),
                torch.zeros(10, dtype=torch.float64, requires_grad=True)):
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[1\]: parameter dtype {bad.dtype}"):
            CPUAdamW([p, bad])
    opt = CPUAdamW([p])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]: parameter is not contiguous"):
        opt.add_param_group({"params": [torch.zeros(4, 4).t().requires_grad_()]})
    assert len(opt.param_groups) == 1, "a refused group is not kept"
    opt = CPUAdamW([p])
    p.grad = torch.ones(10)
    with pytest.raises(ValueError, match="fp16_param_groups"):
        opt.step(fp16_param_groups=[[torch.zeros(10, dtype=torch.bfloat16)], []])
    with pytest.raises(ValueError, match="'half' has 5 elements"):
        opt.step(fp16_param_groups=[[torch.zeros(5, dtype=torch.bfloat16)]])


def test_adam_step_binding_checks_arguments(torch_or_skip):
    torch = torch_or_skip
    import tiermem
    f = torch.zeros(8)
    with pytest.raises(ValueError, match="'grad' must be float32"):
        tiermem.adam_step(f, torch.zeros(8, dtype=torch.float64), f.clone(), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="'exp_avg' has 4 elements"):
        tiermem.adam_step(f, f.clone(), torch.zeros(4), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="'step' must be >= 1"):
        tiermem.adam_step(f, f.clone(), f.clone(), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0)
    with pytest.raises(TypeError, match="'param'"):
        tiermem.adam_step(None, f, f.clone(), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    # Scalars CPUAdamW refuses: a negative lr climbed the loss, a NaN one made every parameter NaN.
    for lr, eps, wd, says in ((-1.0, 1e-8, 0.0, "'lr' must be a finite float32 number >= 0, got -1"),
                              (float("nan"), 1e-8, 0.0, "'lr' must be a finite float32 number >= 0, got nan"),
                              (1e-3, -1e-8, 0.0, "'eps' must be"), (1e-3, 1e-8, float("inf"), "'weight_decay' must be"),
                              (1e300, 1e-8, 0.0, "'lr' must be a finite float32 number")):
        p = torch.ones(8)
        with pytest.raises(ValueError, match=says):
            tiermem.adam_step(p, f.clone(), f.clone(), f.clone(), lr, 0.9, 0.999, eps, wd, 1)
        assert torch.equal(p, torch.ones(8))  # nothing written
    with pytest.raises(ValueError, match="'grad_scale' must be a finite number > 0"):
        tiermem.adam_step(f.clone(), f.clone(), f.clone(), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0.0)
    assert tiermem.adam_isa() in ("avx512", "avx2", "scalar")


def test_an_array_without_a_view_gets_the_hint_that_fits_it(torch_or_skip):
    """view_array's hint names what to do for the tensor given. It used to tell every tensor to
    be .detach()ed first, though a tensor that requires grad is taken (detached) and that hint fit
    none of those refused."""
    torch = torch_or_skip
    import tiermem
    f = torch.zeros(8)
    args = (f.clone(), f.clone(), f.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    p = torch.zeros(8, requires_grad=True)
    tiermem.adam_step(p, f.clone(), *args[1:])  # taken as its data; the step moves no zero param
    assert p.requires_grad and torch.equal(p.detach(), torch.zeros(8))
    with pytest.raises(TypeError, match="meta tensor has no data") as e:
        tiermem.adam_step(torch.zeros(8, device="meta"), *args)
    assert "detach" not in str(e.value)
    with pytest.raises(TypeError, match=r"sparse tensor: call \.to_dense\(\)") as e:
        tiermem.adam_step(torch.zeros(8).to_sparse(), *args)
    assert "detach" not in str(e.value)
    with pytest.raises(TypeError, match="got str$"):
        tiermem.adam_step("not an array", *args)
