"""A released parameter cannot be read or written by mistake (design.md "Released parameters").

Between its module's forwards a managed parameter holds a placeholder. Each read below, made as
libraries and users make it outside the hooks' own paths, must give the engine's values (or raise,
naming the parameter), and each write must reach the engine (master weights and working copy) or
raise, changing nothing. Every case runs the same code on a plain copy of the model and compares:
values after reads, every parameter after writes (``safe_get_full_fp32_param``), gradients after a
backward (``safe_get_full_grad``), and the next forward's logits."""

import copy

import pytest

from torch_models import ds_config, hf_or_skip


def _pair(torch, tmp_path, offload="nvme", frozen=("model.embed_tokens.weight",)):
    """(plain Llama, the same Llama under a tiermem engine, engine); `frozen` parameters do not train."""
    transformers = hf_or_skip()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(cfg)
    for n, p in ref.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    mod = copy.deepcopy(ref)
    import tiermem.torch as tt
    engine, _, _, _ = tt.initialize(model=mod, config=ds_config(tmp_path, offload, tiermem={
        "host_budget_bytes": "1MiB", "device_budget_bytes": "1MiB"}))
    return ref, mod, engine


def _assert_same_params(torch, ref, mod):
    from tiermem.torch.utils import safe_get_full_fp32_param
    for (n, a), (_, b) in zip(ref.named_parameters(), mod.named_parameters()):
        got = safe_get_full_fp32_param(b)
        assert torch.equal(got, a.detach().float()), f"{n}: the engine holds other values than the plain model"


def _assert_same_logits(torch, ref, mod):
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, mod(input_ids=ids).logits)


def _assert_same_grads(torch, ref, mod, what: str, tol: float = 1e-5):
    """Every trainable gradient of `mod` (the engine's, safe_get_full_grad) against `ref`'s p.grad."""
    from tiermem.torch.utils import safe_get_full_grad
    for (n, p), (_, q) in zip(ref.named_parameters(), mod.named_parameters()):
        if p.requires_grad:
            g = safe_get_full_grad(q)
            err = ((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
            assert err <= tol, f"{n}: gradient off by {err:.3g} ({what}, max-abs relative)"


# ------------------------------------------------------------------------------------------ reads

def test_reads_outside_forward_give_the_engines_values(torch_or_skip, tmp_path):
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    F = torch.nn.functional
    w_ref, w = ref.lm_head.weight, mod.lm_head.weight
    emb_ref, emb = ref.model.embed_tokens.weight, mod.model.embed_tokens.weight
    x = torch.randn(3, 32)
    reads = {
        "p.data.clone()": lambda p: p.data.clone(),
        "p.data + 0": lambda p: p.data + 0,
        "ema.add_(p.data)": lambda p: torch.zeros(p.shape).add_(p.data),
        "p.data[2]": lambda p: p.data[2] * 1,
        "p.data.t()": lambda p: p.data.t() * 1,
        "p[1:3] (no_grad)": lambda p: _no_grad(torch, lambda: p[1:3] * 1),
        "p.detach().clone()": lambda p: p.detach().clone(),
        "F.linear(x, p)": lambda p: F.linear(x, p),
        "torch.mm(x, p.t())": lambda p: torch.mm(x, p.t()),
        "x @ p.T": lambda p: x @ p.T,
        "p.data.sum()": lambda p: p.data.sum(),
    }
    for what, read in reads.items():
        for a, b in ((w_ref, w), (emb_ref, emb)):
            want, got = read(a), read(b)
            assert torch.equal(got.detach(), want.detach()), f"{what}: {got} vs {want}"
            assert type(got) is torch.Tensor, f"{what} returned a {type(got).__name__}"
    # A view of .data taken once reads the engine's values at each use, not a snapshot.
    view = mod.lm_head.weight.data[0]
    engine_row = view * 1
    with torch.no_grad():
        mod.lm_head.weight.data[0].fill_(0.5)
    assert torch.equal(view * 1, torch.full_like(engine_row, 0.5))
    engine.close()


def _no_grad(torch, f):
    with torch.no_grad():
        return f()


def test_memory_of_a_released_parameter_is_refused_naming_it(torch_or_skip, tmp_path):
    torch = torch_or_skip
    _, mod, engine = _pair(torch, tmp_path)
    p = mod.model.layers[1].mlp.down_proj.weight
    for call in (p.data_ptr, p.untyped_storage, p.data.data_ptr):
        with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
            call()
    engine.close()


class _SavesWeight:
    """A custom autograd.Function that saves the weight itself and slices it again in backward, as
    TRL's chunked log-prob kernel does with lm_head.weight."""

    @staticmethod
    def make(torch):
        class Chunked(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h, weight):
                ctx.save_for_backward(h, weight)
                return torch.cat([h @ weight[i:i + 16].t() for i in range(0, weight.shape[0], 16)], dim=-1)

            @staticmethod
            def backward(ctx, g):
                h, weight = ctx.saved_tensors
                gh = sum(g[..., i:i + 16] @ weight[i:i + 16] for i in range(0, weight.shape[0], 16))
                flat_h = h.reshape(-1, h.shape[-1])
                gw = torch.cat([g[..., i:i + 16].reshape(-1, 16).t() @ flat_h for i in range(0, weight.shape[0], 16)])
                return gh, gw
        return Chunked


@pytest.mark.parametrize("where", ["after_forward", "inside_forward"])
@pytest.mark.parametrize("head", ["custom_function", "weight_slices", "matmul_t"])
def test_losses_reading_the_head_weight_directly_get_exact_gradients(torch_or_skip, tmp_path, head, where):
    """A loss computed from the hidden states and lm_head.weight outside lm_head's forward: after the
    model's forward, or inside it (TRL's fused head replaces the model's forward with one that runs
    the backbone, then a custom autograd.Function given lm_head.weight, which saves it while it is
    released): gradients equal plain PyTorch's at the first backward. The head is trainable here."""
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    Chunked = _SavesWeight.make(torch)
    ids = torch.arange(16).reshape(2, 8) % 64

    def loss_of(model):
        if where == "inside_forward":
            original = model.forward
            model.forward = lambda **kw: head_loss(model)
            try:
                return model()
            finally:
                model.forward = original
        return head_loss(model)

    def head_loss(model):
        h = model.model(input_ids=ids).last_hidden_state
        w = model.lm_head.weight
        if head == "custom_function":
            logits = Chunked.apply(h, w)
        elif head == "weight_slices":
            logits = torch.cat([h @ w[i:i + 16].t() for i in range(0, w.shape[0], 16)], dim=-1)
        else:
            logits = torch.mm(h.reshape(-1, h.shape[-1]), w.t()).reshape(2, 8, -1)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64)[:-1], ids.reshape(-1)[1:])

    a = loss_of(ref)
    a.backward()
    b = loss_of(mod)
    engine.backward(b)
    assert torch.equal(a.detach(), b.detach())
    _assert_same_grads(torch, ref, mod, f"{head} {where}")
    engine.close()


@pytest.mark.parametrize("flavour", ["reentrant", "non_reentrant", "save_on_cpu"])
def test_outer_saved_tensor_hooks_and_checkpointing_keep_gradients_exact(torch_or_skip, tmp_path, flavour):
    """The user's own torch.utils.checkpoint around the model (either flavour) or save_on_cpu:
    gradients equal plain PyTorch's with a frozen norm (the weight a recompute keeps by reference)."""
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path, frozen=("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                                      "model.layers.1.post_attention_layernorm.weight",
                                                      "model.norm.weight"))
    ids = torch.arange(16).reshape(2, 8) % 64
    from torch.utils.checkpoint import checkpoint

    def loss_of(model):
        if flavour == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return model(input_ids=ids, labels=ids).loss
        # The (frozen) embedding outside, so that the checkpointed part has an input requiring grad, as
        # reentrant checkpointing needs (transformers' enable_input_require_grads does the same).
        e = model.model.embed_tokens(ids).detach().requires_grad_()
        return checkpoint(lambda x: model(inputs_embeds=x, labels=ids).loss, e, use_reentrant=flavour == "reentrant")

    a = loss_of(ref)
    a.backward()
    b = loss_of(mod)
    engine.backward(b)
    assert torch.equal(a.detach(), b.detach())
    _assert_same_grads(torch, ref, mod, f"under {flavour}")
    engine.close()


# ------------------------------------------------------------------------------------------ writes

def _writes(torch):
    nn = torch.nn
    t = torch.linspace(-1, 1, 64 * 32).reshape(64, 32)
    return {
        "p.copy_(t) under no_grad": lambda m: _no_grad(torch, lambda: m.lm_head.weight.copy_(t)),
        "p.data.copy_(t)": lambda m: m.lm_head.weight.data.copy_(t),
        "p.data = t": lambda m: setattr(m.lm_head.weight, "data", t.clone()),
        "p.data.mul_(2).add_(1)": lambda m: m.lm_head.weight.data.mul_(2).add_(1),
        "p.data[3] = 7": lambda m: m.lm_head.weight.data.__setitem__(3, 7.0),
        "p[pad].zero_() under no_grad": lambda m: _no_grad(torch, lambda: m.model.embed_tokens.weight[5].zero_()),
        "p.data[pad].zero_() on a frozen weight": lambda m: m.model.embed_tokens.weight.data[5].zero_(),
        "nn.init.constant_(p, v)": lambda m: nn.init.constant_(m.model.norm.weight, 0.25),
        "nn.init.normal_(p.data)": lambda m: (torch.manual_seed(3), nn.init.normal_(m.lm_head.weight.data)),
        "model.apply(zeros_) under no_grad": lambda m: _no_grad(torch, lambda: m.apply(
            lambda mod: [nn.init.zeros_(p) for p in mod.parameters(recurse=False)])),
        "model.apply(normal_ on .data)": lambda m: (torch.manual_seed(4), m.apply(
            lambda mod: [p.data.normal_(0, 0.02) for p in mod.parameters(recurse=False)])),
        # A list of parameters written at once (EMA and weight-averaging code): the gathered
        # working copy alone changed, the master weights not, and the next step undid it.
        "torch._foreach_mul_([p.data ...], 0.5)": lambda m: torch._foreach_mul_([p.data for p in m.parameters()], 0.5),
        "torch._foreach_lerp_(params, zeros, 0.5) under no_grad": lambda m: _no_grad(torch, lambda: torch._foreach_lerp_(
            list(m.parameters()), [torch.zeros(p.shape) for p in m.parameters()], 0.5)),
        # Views that come as a tuple: writes into them changed the working copy alone.
        "p.data.split(16)[0].mul_(0)": lambda m: m.lm_head.weight.data.split(16)[0].mul_(0),
        "p.chunk(2)[1].fill_(0.5) under no_grad": lambda m: _no_grad(torch, lambda: m.lm_head.weight.chunk(2)[1].fill_(0.5)),
        "p.data.unbind(0)[3].zero_() on a frozen weight": lambda m: m.model.embed_tokens.weight.data.unbind(0)[3].zero_(),
        "torch._foreach_copy_([p.data ...], values)": lambda m: torch._foreach_copy_(
            [p.data for p in m.parameters()], [torch.full(p.shape, 0.125) for p in m.parameters()]),
    }


@pytest.mark.parametrize("what", list(_writes(__import__("torch")).keys()) + ["load_state_dict"])
def test_writes_after_initialize_reach_the_engine(torch_or_skip, tmp_path, what):
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    if what == "load_state_dict":
        other = copy.deepcopy(ref)
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-0.5)
        result = mod.load_state_dict(other.state_dict())
        assert not result.missing_keys and not result.unexpected_keys
        ref.load_state_dict(other.state_dict())
    else:
        write = _writes(torch)[what]
        write(ref)
        write(mod)
    _assert_same_params(torch, ref, mod)
    _assert_same_logits(torch, ref, mod)
    engine.close()


def test_writes_that_cannot_reach_the_engine_are_refused_at_the_call(torch_or_skip, tmp_path):
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    w = mod.lm_head.weight
    with pytest.raises(ValueError, match=r"lm_head\.weight.*nothing was changed"):
        w.data = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        w.data = torch.zeros(64, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"to torch\.bfloat16 after initialize is refused"):
        mod.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"after initialize is refused"):
        mod.half()
    assert all(p.dtype == torch.float32 for p in mod.parameters())
    _assert_same_params(torch, ref, mod)
    _assert_same_logits(torch, ref, mod)
    engine.close()


def test_reads_between_steps_stay_outside_the_recorded_trace(torch_or_skip, tmp_path, capfd):
    """state_dict() and an EMA of p.data between steps (what the HF Trainer's saves and EMA code do)
    gather outside the step's recorded trace: the engine's prefetch trace does not diverge."""
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    ids = torch.arange(16).reshape(2, 8) % 64
    ema = {n: torch.zeros(p.shape) for n, p in mod.named_parameters()}
    capfd.readouterr()
    for _ in range(4):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        mod.state_dict()
        for n, p in mod.named_parameters():
            ema[n].mul_(0.9).add_(p.data, alpha=0.1)
    err = capfd.readouterr().err
    assert "access trace diverged" not in err, err[-2000:]
    engine.close()


def test_resize_token_embeddings_after_initialize_is_refused_at_the_call(torch_or_skip, tmp_path):
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    with pytest.raises((ValueError, RuntimeError), match=r"embed_tokens\.weight|after initialize"):
        mod.resize_token_embeddings(80)
    assert mod.model.embed_tokens.weight.shape == (64, 32)
    _assert_same_params(torch, ref, mod)
    _assert_same_logits(torch, ref, mod)
    engine.close()


def test_a_users_saved_tensor_hooks_see_every_saved_tensor(torch_or_skip, tmp_path):
    """An outer saved-tensor hook pair (what save_on_cpu and activation offloading are) packs every
    tensor autograd saves in the model's forward, activations and parameters alike, as without
    tiermem: the hooks chain to it instead of shadowing it, and the gradients stay exact."""
    torch = torch_or_skip
    ref, mod, engine = _pair(torch, tmp_path)
    ids = torch.arange(16).reshape(2, 8) % 64
    counts = {}

    def run(model, key):
        counts[key] = 0

        def pack(t):
            counts[key] += 1
            return t.detach().clone()  # a copy, as save_on_cpu makes one

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return model(input_ids=ids, labels=ids).loss

    a = run(ref, "plain")
    a.backward()
    b = run(mod, "tiermem")
    engine.backward(b)
    assert counts["tiermem"] == counts["plain"] > 0
    _assert_same_grads(torch, ref, mod, "under a user's saved-tensor hooks")
    engine.close()


# ------------------------------------------------------------------------------------------ held tensors

@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_a_detached_parameter_held_across_steps_is_the_parameter(torch_or_skip, tmp_path, offload):
    """torch's p.detach() shares the parameter's memory: held across steps it shows each update, and
    a write into it changes the parameter. A released parameter's detach() was a copy: it still read
    the first weights after the steps, and writes into it were lost without a word; p.data.detach()
    held the unit's gathered memory, and with the parameters on the device every later step failed
    ("pinned on device") (found by a helper trying the product as a new user). Now both are p.data's
    proxy. A numpy array of a released parameter is a copy of the values at the call, as
    .cpu().numpy() of a GPU tensor is, and holds none of the engine's memory; state_dict() still
    gives tensors of their own."""
    torch = torch_or_skip
    from tiermem.torch.utils import safe_get_full_fp32_param
    _, mod, engine = _pair(torch, tmp_path, offload)
    w = mod.lm_head.weight
    held = {"p.detach()": w.detach(), "p.data.detach()": w.data.detach(), "torch.detach(p)": torch.detach(w),
            "p.detach().t()": w.detach().t()}
    with torch.no_grad():
        held["p.detach() under no_grad"] = w.detach()
    held["p.data.chunk(2)[0].t()"] = w.data.chunk(2)[0].t()  # a tuple's view: it pinned the unit too
    first = w.detach().clone()
    arr = w.detach().numpy()
    ids = torch.arange(12).reshape(2, 6) % 64
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    now = safe_get_full_fp32_param(w)
    assert not torch.equal(now, first)  # the steps changed it
    for what, t in held.items():
        assert not t.requires_grad, what
        got = t.t() * 1 if what.endswith(".t()") else t * 1
        assert torch.equal(got, now[:got.shape[0]]), f"{what}: the values of before the steps"
    assert (arr == first.numpy()).all()
    held["p.detach()"].fill_(0.25)
    assert torch.equal(safe_get_full_fp32_param(w), torch.full_like(now, 0.25))
    with torch.no_grad():
        w.detach().mul_(2)
    assert torch.equal(safe_get_full_fp32_param(w), torch.full_like(now, 0.5))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # with every held tensor alive
    sd = mod.state_dict()
    assert type(sd["lm_head.weight"]) is torch.Tensor
    assert torch.equal(sd["lm_head.weight"], safe_get_full_fp32_param(w))
    engine.close()
