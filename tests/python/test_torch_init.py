"""tiermem.torch.zero.Init: a model built inside trains with the same losses as one built outside
(the same RNG stream through torch's and HF's init code), and host memory does not grow with the
model: three Llama shapes (1, 4 and 16 layers: 9x the state from the first to the last) built under
Init with their state on NVMe at fixed budgets, each in its own process, reach max RSS (getrusage)
within 128 MiB of each other. The baseline (torch, transformers and tiermem imported, nothing
built) is printed beside them."""

import json
import os
import subprocess
import sys

import pytest

from torch_models import batches, build, ds_config, engine_losses, hf_or_skip, reference_losses

HERE = os.path.dirname(os.path.abspath(__file__))


def test_init_losses_equal_plain_pytorch(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    data = batches(5)
    for kind in ("gpt2", "llama"):
        want = reference_losses(build(kind), data, 5)
        with tt.zero.Init(config=cfg):
            model = build(kind)
        w = model.lm_head.weight
        assert w.shape == (128, 64) and w.stride() == (0, 0)  # a placeholder: no memory of its own
        # Run before initialize took its parameters, the model computed other outputs, silently.
        with pytest.raises(RuntimeError, match="built under tiermem.torch.zero.Init.*call initialize before"):
            model(input_ids=data[0])
        engine, *_ = tt.initialize(model=model, config=cfg)
        assert not any("_tm_init_guard" in m.__dict__ for m in model.modules())  # the guards are gone
        assert [f for f in os.listdir(tmp_path) if f.startswith("tiermem-init-")] == []  # Init store gone
        got = engine_losses(engine, data, 5)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5
        engine.close()


def _run(layers: int, swap: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(HERE, "init_rss_worker.py"), str(layers), swap],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_host_memory_does_not_grow_with_the_model(torch_or_skip, tmp_path):
    hf_or_skip()
    base = _run(0, str(tmp_path))
    runs = []
    for layers in (1, 4, 16):
        swap = tmp_path / f"swap{layers}"
        swap.mkdir()
        runs.append(_run(layers, str(swap)))
    mib = 1 << 20
    for r in [base] + runs:
        print(f"layers {r['layers']:2d}: params {r.get('params', 0):>9,}  optimizer state "
              f"{r.get('optimizer_state_bytes', 0) / mib:7.1f} MiB  max RSS {r['max_rss_bytes'] / mib:6.1f} MiB")
    assert runs[-1]["optimizer_state_bytes"] >= 8 * runs[0]["optimizer_state_bytes"]
    rss = [r["max_rss_bytes"] for r in runs]
    assert max(rss) - min(rss) < 128 * mib, rss


def test_data_given_under_init_before_initialize_is_kept(torch_or_skip, tmp_path):
    """`p.data = t` on a parameter built under Init, before initialize: t is what the engine
    trains (the stored value won, silently); t of another shape is refused, naming both."""
    torch = torch_or_skip
    import pytest
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme")
    with tt.zero.Init(config=cfg):
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    m[0].weight.data = torch.ones(16, 8)
    engine, *_ = tt.initialize(model=m, config=cfg)
    with tt.zero.GatheredParameters([m[0].weight]):
        assert torch.equal(m[0].weight.detach(), torch.ones(16, 8))
    engine.close()
    with tt.zero.Init(config=cfg):
        m = torch.nn.Sequential(torch.nn.Linear(8, 16))
    m[0].weight.data = torch.ones(3)
    with pytest.raises(ValueError, match=r"built under zero.Init as \(16, 8\) torch.float32 was given .data of \(3,\)"):
        tt.initialize(model=m, config=cfg)


def test_writes_through_data_under_init_reach_the_staging(torch_or_skip, tmp_path):
    """`p.data.copy_(t)` on a parameter built under Init, before initialize, failed with torch's
    "more than one element of the written-to tensor refers to a single memory location" (p.data was
    the placeholder), and `p.data.clone()` read meaningless values; a read of the parameter after
    `p.data = t` loaded the stored values over t. Each now reads and writes the stored values, on
    NVMe and in host memory, and initialize trains what was written."""
    torch = torch_or_skip
    import tiermem.torch as tt
    for cfg in (ds_config(tmp_path / "swap", "nvme"), ds_config(tmp_path, "none")):
        with tt.zero.Init(config=cfg):
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        w, b, w2 = m[0].weight, m[0].bias, m[1].weight
        want = torch.arange(128, dtype=torch.float32).reshape(16, 8)
        d = w.data
        d.copy_(want)
        assert torch.equal(w.data.clone(), want) and torch.equal(d.clone(), want)
        assert w.stride() == (0, 0)  # still stored: no memory of its own
        torch.nn.init.constant_(b.data, 2.0)
        b.data.add_(1.0)
        w2.data = torch.full((4, 16), 5.0)  # supported before: t is the value...
        assert float(w2.detach().sum()) == 5.0 * 64  # ... also after the parameter was read
        engine, *_ = tt.initialize(model=m, config=cfg)
        with tt.zero.GatheredParameters([w, b, w2]):
            assert torch.equal(w.detach(), want)
            assert torch.equal(b.detach(), torch.full((16,), 3.0))
            assert torch.equal(w2.detach(), torch.full((4, 16), 5.0))
        # A .data taken while stored holds no values once initialize took the parameter.
        with pytest.raises(RuntimeError, match=r"the .data of a parameter \(16, 8\) torch.float32 taken while "
                                               r"zero.Init stored it.*GatheredParameters"):
            d.copy_(want)
        engine.close()


def test_in_host_memory_an_in_place_init_keeps_the_stored_tensor(torch_or_skip, tmp_path):
    """A config that offloads nothing to NVMe keeps the Init store in host memory. An in-place
    initialisation through the parameter (as HF's post_init runs `_init_weights` over the built
    model) changes the stored tensor where it is: it was copied, and freeing the old one made
    glibc serve later blocks from its heap, which the steps then spread over (the 246 M LoRA's max
    RSS grew by ~35 MiB in 5 steps). Values as written; initialize trains them."""
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "none")
    with tt.zero.Init(config=cfg):
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    w = m[0].weight
    store = w._tm_init_store
    held = store.mem[id(w)]
    where = held.data_ptr()
    torch.manual_seed(5)
    torch.nn.init.normal_(w, std=0.5)
    torch.manual_seed(5)
    want = torch.empty(64, 64).normal_(std=0.5)
    assert store.mem[id(w)] is held and held.data_ptr() == where
    assert torch.equal(held, want)
    engine, *_ = tt.initialize(model=m, config=cfg)
    with tt.zero.GatheredParameters([w]):
        assert torch.equal(w.detach(), want)
    engine.close()


def test_data_of_one_staged_parameter_given_to_another_under_init(torch_or_skip, tmp_path):
    """`a.weight.data = b.weight.data` with both built under Init (transformers'
    resize_token_embeddings hands the new embedding's values to the old parameter so) left `a`
    its own old values, silently, or, of another shape, failed in initialize with a size mismatch.
    `a` now holds b's values at b's shape; a resized HF model equals one resized without Init."""
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / "swap", "nvme")
    for rows in (4, 6):
        with tt.zero.Init(config=cfg):
            a = torch.nn.Linear(2, 4, bias=False)
            b = torch.nn.Linear(2, rows, bias=False)
            with torch.no_grad():
                b.weight.fill_(7.0)
            a.weight.data = b.weight.data
        assert a.weight.shape == (rows, 2)
        engine, *_ = tt.initialize(model=torch.nn.Sequential(a), config=cfg)
        with tt.zero.GatheredParameters([a.weight]):
            assert torch.equal(a.weight.detach(), torch.full((rows, 2), 7.0))
        engine.close()
    hf_or_skip()
    for kind in ("gpt2", "llama"):
        torch.manual_seed(0)
        plain = build(kind)
        plain.resize_token_embeddings(160)
        want = {k: v.detach().clone() for k, v in plain.named_parameters()}
        torch.manual_seed(0)
        with tt.zero.Init(config=cfg):
            model = build(kind)
            model.resize_token_embeddings(160)
        engine, *_ = tt.initialize(model=model, config=cfg)
        with tt.zero.GatheredParameters(list(model.parameters())):
            for k, v in model.named_parameters():
                assert torch.equal(v.detach(), want[k]), k
        engine.close()


EXITS_UNDER_INIT = r"""
import sys, torch
import tiermem.torch as tt
from torch_models import ds_config
with tt.zero.Init(config=ds_config(sys.argv[1], "nvme")):
    model = torch.nn.Linear(8, 16)
print(sorted(__import__("os").listdir(sys.argv[1])), flush=True)
# the interpreter exits with the stored model alive
"""


def test_init_leaves_nothing_behind_without_initialize(torch_or_skip, tmp_path):
    """A model built under Init that never reached initialize left the directories Init made for
    its Init store file (with tiermem's marker) behind, after it was deleted and after the process
    exited. They go with the model, or at exit; the user's own directory stays."""
    torch = torch_or_skip
    import gc
    import subprocess
    import sys
    import tiermem.torch as tt
    user = tmp_path / "user"
    user.mkdir()  # the user's: stays, empty
    for swap in (user / "made" / "by-init", user):
        init = tt.zero.Init(config=ds_config(swap, "nvme"))  # a kept Init object keeps nothing alive
        with init:
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        assert [f for f in os.listdir(swap) if f.startswith("tiermem-init-")], os.listdir(swap)
        del m
        gc.collect()
        assert os.listdir(user) == [], [os.path.join(r, f) for r, ds, fs in os.walk(user) for f in ds + fs]
    # A directory holding something else stays (with its marker: still tiermem's), the file goes.
    swap = user / "shared"
    with tt.zero.Init(config=ds_config(swap, "nvme")):
        m = torch.nn.Linear(8, 16)
    (swap / "other").write_text("x")
    del m
    gc.collect()
    assert sorted(os.listdir(swap)) == [".tiermem-made", "other"]
    # At interpreter exit, with the stored model alive.
    nvme = tmp_path / "exit" / "swap"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", EXITS_UNDER_INIT, str(nvme)], capture_output=True, text=True,
                       timeout=300, cwd=HERE, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "tiermem-init-" in p.stdout, p.stdout  # the Init store file was there while it ran
    assert os.listdir(tmp_path / "user") == ["shared"] and not (tmp_path / "exit").exists()


FORKS_UNDER_INIT = r"""
import gc, json, os, sys, torch
import tiermem.torch as tt
from torch_models import ds_config
swap = sys.argv[1]
cfg = ds_config(swap, "nvme")
with tt.zero.Init(config=cfg):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
before = sorted(os.listdir(swap))
pid = os.fork()
if pid == 0:  # the child collects its copy of the model, then exits as an interpreter does (atexit)
    del model
    gc.collect()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
after = sorted(os.listdir(swap))
engine, *_ = tt.initialize(model=model, config=cfg)
engine.backward(engine(torch.ones(2, 8)).sum())
engine.step()
engine.close()
print(json.dumps({"status": status, "before": before, "after": after}), flush=True)
"""


def test_a_forked_child_leaves_the_parents_staging(torch_or_skip, tmp_path):
    """A process that forked after building under Init lost its Init store when the child exited:
    the child ran the Init store's clean-up (weakref.finalize at exit, or on collecting its copy of the
    model) and deleted the parent's tiermem-init-*.bin and the directories tiermem made. The
    clean-up runs only in the process that made the Init store: the parent's file stays through the
    child's exit, initialize reads it, and the parent's exit still removes what tiermem made."""
    import json
    import subprocess
    import sys
    if not hasattr(os, "fork"):
        pytest.skip("os.fork is not available on this platform")
    swap = tmp_path / "made" / "swap"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", FORKS_UNDER_INIT, str(swap)], capture_output=True, text=True,
                       timeout=300, cwd=HERE, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["status"] == 0, r
    assert any(f.startswith("tiermem-init-") for f in r["before"]), r
    assert r["after"] == r["before"], r  # the child took nothing of the parent's
    assert not (tmp_path / "made").exists()  # gone with the parent, as before


def test_module_classes_defined_inside_init_are_staged(torch_or_skip, tmp_path):
    """transformers imports a model's file on the first use of its name, often inside the Init
    block (GPT-2's Conv1D was missed so, and its 85 M parameters stayed in host memory): a Module
    class defined inside the block is stored like one defined before it, and not after the block."""
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme")
    with tt.zero.Init(config=cfg):
        class Late(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(64, 32))

        late = Late()
    assert late.w.shape == (64, 32) and late.w.stride() == (0, 0)  # a placeholder: stored
    assert "__init_subclass__" not in torch.nn.Module.__dict__  # the hook is gone after the block
    assert Late().w.stride() == (32, 1)  # built outside: its own memory


def _padded_model(torch):
    """An embedding with a padding index and a head, initialised again by the parent after its
    children were built, as HF's post_init does: by views of the parameters (p[i], p.data[i],
    nested views), and by an index that copies (which must leave the parameter as it is)."""

    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, padding_idx=3)
            self.head = torch.nn.Linear(4, 10)
            with torch.no_grad():
                torch.nn.init.normal_(self.emb.weight)
                torch.nn.init.zeros_(self.emb.weight[self.emb.padding_idx])  # transformers' _init_weights
                self.head.weight.data[7].zero_()  # older transformers' form
                self.head.weight.t()[1].fill_(0.25)  # a view of a view
                self.head.weight.view(-1)[:3].copy_(torch.tensor([1.0, 2.0, 3.0]))
                self.head.bias[[0, 2]].fill_(9.0)  # a copy in torch: the bias is unchanged
                self.head.bias[1:3] = self.emb.weight[5][:2]  # a view read into a view

        def forward(self, ids):
            return self.head(self.emb(ids))

    return Padded()


def test_writes_through_views_under_init_reach_the_staging(torch_or_skip, tmp_path):
    """A model with a padding index built under Init got other initial weights than built without
    it: transformers' `_init_weights` runs `init.zeros_(module.weight[module.padding_idx])` after the
    module was stored, and `p[i]` was a view of a copy loaded for that one call, so the write was
    lost and the padding row stayed random (LlamaConfig(pad_token_id=3); BERT's pad_token_id is 0).
    A view of a stored parameter now stands for the stored values at each later call: the
    parameters after initialize, and the first losses, equal those of the model built outside Init."""
    torch = torch_or_skip
    import tiermem.torch as tt

    def check(build, loss_of, cfg):
        torch.manual_seed(0)
        ref = build()
        torch.manual_seed(0)
        with tt.zero.Init(config=cfg):
            model = build()
        engine, *_ = tt.initialize(model=model, config=cfg)
        params = list(model.parameters())
        with tt.zero.GatheredParameters(params):
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.detach(), q.detach()), name
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for step in range(2):
            torch.manual_seed(step)
            got = loss_of(engine)
            engine.backward(got)
            engine.step()
            torch.manual_seed(step)
            want = loss_of(ref)
            opt.zero_grad()
            want.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()), (step, got.item(), want.item())
        engine.close()

    ids = torch.tensor([[1, 3, 5, 3], [3, 2, 9, 0]])
    for offload in ("nvme", "none"):
        check(lambda: _padded_model(torch), lambda m: m(ids).square().mean(), ds_config(tmp_path / "swap", offload))
    # After initialize, a view taken while stored holds no values, and says so.
    cfg = ds_config(tmp_path / "swap", "nvme")
    with tt.zero.Init(config=cfg):
        m = torch.nn.Embedding(10, 4, padding_idx=3)
    row = m.weight[3]
    assert row.shape == (4,) and torch.equal(row.clone(), torch.zeros(4))
    engine, *_ = tt.initialize(model=m, config=cfg)
    with pytest.raises(RuntimeError, match=r"a view \(p\[...\].*of a parameter \(10, 4\) torch.float32 taken while "
                                           r"zero.Init stored it.*GatheredParameters"):
        row.zero_()
    engine.close()
    transformers = hf_or_skip()
    data = batches(2)
    llama = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, pad_token_id=3)
    for conf, cls in ((llama, transformers.LlamaForCausalLM),
                      (transformers.BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=2, vocab_size=128, max_position_embeddings=32),
                       transformers.BertForMaskedLM)):
        check(lambda: cls(conf), lambda m: m(input_ids=data[0], labels=data[0]).loss,
              ds_config(tmp_path / "swap", "nvme"))
