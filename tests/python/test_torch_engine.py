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


def test_stats_split_nvme_traffic_by_kind_and_phase_and_price_the_step(torch_or_skip, tmp_path):
    """engine.stats() at budgets where every step pages through NVMe: the traffic by kind of state
    (trainable, frozen, optimizer, gradient: the gradient partitions are written down in backward)
    and by phase ('phases': forward, backward, optimizer, other, outside) each sums to the totals;
    the last step's figures, and its I/O bound at the nvme_*_gbps of the config."""
    hf_or_skip()
    import tiermem.torch as tt
    tiermem = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB", "nvme_read_gbps": 2.0,
               "nvme_write_gbps": 4.0}
    engine, *_ = tt.initialize(model=build("gpt2"), config=ds_config(tmp_path, "nvme", tiermem=tiermem))
    engine_losses(engine, batches(3), 3)
    st = engine.stats()
    assert st["gradient_home"] == "nvme"
    assert st["nvme_written_gradient_bytes"] > 0
    for d in ("read", "written"):
        kinds = sum(st[f"nvme_{d}_{k}_bytes"] for k in ("trainable", "frozen", "optimizer", "gradient"))
        assert kinds == st[f"nvme_{d}_bytes"], d
    phases = st["phases"]
    assert set(phases) == {"forward", "backward", "optimizer", "other", "outside"}
    for name, p in phases.items():
        assert set(p) == {"nvme_read_bytes", "nvme_written_bytes", "stall_ns", "helper_stall_ns", "io_busy_ns",
                          "hidden_io_ns"}, name
        assert 0 <= p["helper_stall_ns"] <= p["stall_ns"], name
        assert p["hidden_io_ns"] == max(0, p["io_busy_ns"] - (p["stall_ns"] - p["helper_stall_ns"])), name
    assert sum(p["nvme_read_bytes"] for p in phases.values()) == st["nvme_read_bytes"]
    assert sum(p["nvme_written_bytes"] for p in phases.values()) == st["nvme_written_bytes"]
    assert sum(p["stall_ns"] for p in phases.values()) == st["stall_ns"]
    assert phases["forward"]["nvme_read_bytes"] > 0 and phases["forward"]["io_busy_ns"] > 0
    assert phases["optimizer"]["nvme_written_bytes"] > 0
    # The last step: part of the totals, timed, its bound the bytes at 2 and 4 GB/s.
    assert 0 < st["last_step_nvme_read_bytes"] < st["nvme_read_bytes"]
    assert 0 < st["last_step_nvme_written_bytes"] < st["nvme_written_bytes"]
    assert st["step_wall_s"] > 0 and 0 <= st["stall_s"] and 0 <= st["compute_s"] <= st["step_wall_s"]
    assert (st["nvme_read_gbps"], st["nvme_write_gbps"]) == (2.0, 4.0)
    bound = (st["last_step_nvme_read_bytes"] / 2e9 + st["last_step_nvme_written_bytes"] / 4e9)
    assert st["io_bound_s"] > 0 and abs(st["io_bound_s"] - bound) < 1e-8
    engine.close()


def test_tiermem_trace_is_written_at_exit(torch_or_skip, tmp_path):
    """TIERMEM_TRACE=path from Python: the library records from its first use and writes the file
    when the process exits (a script never calls save itself): valid Chrome-trace JSON with the
    engine's NVMe spans."""
    hf_or_skip()
    import json
    import subprocess
    import sys
    trace = tmp_path / "run.trace.json"
    script = f"""
import sys
sys.path.insert(0, {repr(str(__import__('os').path.dirname(__file__)))})
import tiermem.torch as tt
from torch_models import batches, build, ds_config, engine_losses
cfg = ds_config({repr(str(tmp_path))}, "nvme", tiermem={{"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}})
engine, *_ = tt.initialize(model=build("gpt2"), config=cfg)
engine_losses(engine, batches(2), 2)
engine.close()
"""
    env = dict(__import__("os").environ, TIERMEM_TRACE=str(trace))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans, tracks
    assert any("nvme" in t for t in tracks), tracks
    assert not (tmp_path / "run.trace.json.tmp").exists()


def test_a_lent_gradient_is_read_then_let_go(torch_or_skip, tmp_path):
    """ZeroEngine.reduce_gradients(lend=True), what the units call: the engine holds the array
    while its gradient thread adds it (one rank, stage 3), never writes it, and lets go of it once
    done; the step is the one a copied gradient gives, bit for bit; a bad array is an exception
    that leaks no reference."""
    import sys
    torch = torch_or_skip
    import tiermem.torch as tt
    from torch_models import ds_config

    masters = []
    for lend in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        engine, _, _, _ = tt.initialize(model=model, model_parameters=model.parameters(),
                                        config=ds_config(tmp_path / str(lend), "nvme"))
        z = engine._zero
        n = z.module_numel(0)
        g = torch.linspace(-1.0, 1.0, n, dtype=torch.float32)
        before = g.clone()
        held = sys.getrefcount(g)
        z.reduce_gradients(0, g, lend=lend)
        z.synchronize()  # waits for the hand-off, and lets go of what the engine is done with
        assert sys.getrefcount(g) == held
        assert torch.equal(g, before)
        z.step()
        masters.append(z.export_master(0).clone())
        with pytest.raises(ValueError, match="float32"):
            z.reduce_gradients(0, g.double(), lend=True)
        with pytest.raises(TypeError, match="argument 'grad' is None"):
            z.reduce_gradients(0, None, lend=True)
        with pytest.raises(ValueError, match="negated view"):  # DLPack would give its memory unnegated
            z.reduce_gradients(0, torch.ones(n)._neg_view(), lend=lend)
        bad = torch.zeros(n + 1)
        held = sys.getrefcount(bad)
        with pytest.raises(ValueError, match="elements"):
            z.reduce_gradients(0, bad, lend=True)
        assert sys.getrefcount(bad) == held
        engine.close()
    assert torch.equal(masters[0], masters[1])
