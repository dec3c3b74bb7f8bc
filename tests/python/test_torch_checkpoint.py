"""tiermem.torch checkpoints: save, load into a fresh model and continue bit for bit; a corrupt
or foreign checkpoint is refused naming what is wrong; the consolidated fp32 export loads into the
plain model with torch.load + load_state_dict and equals the trained master weights;
GatheredParameters shows full parameters and writes changes back."""

import json
import os

import pytest

from torch_models import batches, build, ds_config, engine_losses, hf_or_skip


def _cfg(tmp_path, **kw):
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}}
    return ds_config(tmp_path / "swap", "nvme", scheduler=sched,
                     tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}, **kw)


def _engine(tt, tmp_path, kind="gpt2", **kw):
    (tmp_path / "swap").mkdir(exist_ok=True)
    model = build(kind)
    engine, *_ = tt.initialize(model=model, config=_cfg(tmp_path, **kw))
    return model, engine


def test_save_load_continue_bit_for_bit(torch_or_skip, tmp_path, capfd):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(12)
    _, a = _engine(tt, tmp_path)
    engine_losses(a, data[:6], 6)
    path = a.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3})
    assert os.path.basename(path) == "global_step6"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step6"
    want = engine_losses(a, data[6:], 6)
    lr_want = a.get_lr()
    a.close()

    _, b = _engine(tt, tmp_path)
    capfd.readouterr()
    _, client = b.load_checkpoint(str(tmp_path / "ckpt"))
    assert client == {"epoch": 3}
    assert b.global_steps == 6
    got = engine_losses(b, data[6:], 6)
    assert got == want  # bit for bit: the same floats
    # The first step after a load applies no deferred updates: an order the engine changed on
    # purpose, not a divergence to warn about.
    assert "access trace diverged" not in capfd.readouterr().err
    assert b.get_lr() == lr_want
    b.close()


def test_corrupt_and_foreign_checkpoints_are_refused(torch_or_skip, tmp_path):
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(2)
    _, a = _engine(tt, tmp_path)
    engine_losses(a, data, 2)
    d = a.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    a.close()
    rank_dir = os.path.join(d, "rank0")
    state = [f for f in os.listdir(rank_dir) if f.startswith("state")][0]
    with open(os.path.join(rank_dir, state), "r+b") as f:  # flip one byte of the master weights
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    _, b = _engine(tt, tmp_path)
    with pytest.raises(RuntimeError, match="optimizer.master"):
        b.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    with pytest.raises(FileNotFoundError, match="latest"):
        b.load_checkpoint(str(tmp_path / "nothing"))
    # `latest` naming a path outside the directory, and a directory that is no checkpoint.
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "latest").write_text("../..")
    with pytest.raises(ValueError, match=r"latest names '\.\./\.\.', not a checkpoint directory"):
        b.load_checkpoint(str(tmp_path / "outside"))
    for tag in ("../ckpt/t", "/etc", ".."):  # a tag given leaves the directory no more than `latest` may
        with pytest.raises(ValueError, match="must be a plain directory name"):
            b.load_checkpoint(str(tmp_path / "outside"), tag=tag)
    (tmp_path / "empty" / "t").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="is not a checkpoint: it has no rank0/manifest.json"):
        b.load_checkpoint(str(tmp_path / "empty"), tag="t")
    b.close()
    # A client_state that cannot be pickled: refused before anything is written.
    _, g = _engine(tt, tmp_path)
    with pytest.raises(TypeError, match="client_state cannot be pickled"):
        g.save_checkpoint(str(tmp_path / "fresh" / "ck"), tag="c", client_state={"f": lambda x: x})
    assert not (tmp_path / "fresh").exists()
    # A save that fails part way (here: the state export) removes every directory it made, the
    # missing parents of save_dir included, and names no tag in `latest`.
    def failing_export(sink):
        raise RuntimeError("injected export failure")
    g.export_optimizer_state = failing_export
    with pytest.raises(RuntimeError, match="injected export failure"):
        g.save_checkpoint(str(tmp_path / "fresh" / "deep" / "ck"), tag="c")
    assert not (tmp_path / "fresh").exists()
    del g.export_optimizer_state
    g.close()
    # A manifest whose meta was edited: refused at load, naming the key, before anything changes.
    _, f = _engine(tt, tmp_path)
    engine_losses(f, data, 1)
    good = f.save_checkpoint(str(tmp_path / "meta"), tag="m")
    manifest = os.path.join(good, "rank0", "manifest.json")
    original = open(manifest).read()
    for key, value, match in (("global_steps", -3, "'global_steps' = -3 must be an integer >= 0"),
                              ("micro_steps", "abc", "'micro_steps' = 'abc' must be an integer >= 0"),
                              ("lr", [-5.0], r"'lr' = \[-5.0\] must be a list of finite learning rates")):
        m = json.loads(original)
        meta = json.loads(m["meta"]) if isinstance(m["meta"], str) else m["meta"]
        meta[key] = value
        m["meta"] = json.dumps(meta) if isinstance(m["meta"], str) else meta
        with open(manifest, "w") as out:
            json.dump(m, out)
        with pytest.raises(ValueError, match=match):
            f.load_checkpoint(str(tmp_path / "meta"), tag="m")
        assert f.global_steps == 1, key  # nothing loaded
    f.close()
    # A checkpoint of another model is refused naming the first differing engine module.
    _, c = _engine(tt, tmp_path, kind="llama")
    engine_losses(c, data, 1)
    c.save_checkpoint(str(tmp_path / "other"), tag="t")
    c.close()
    _, e = _engine(tt, tmp_path)
    with pytest.raises(ValueError, match="engine module 0"):
        e.load_checkpoint(str(tmp_path / "other"), tag="t")
    e.close()


def test_fp32_export_loads_into_the_plain_model(torch_or_skip, tmp_path):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(4)
    model, a = _engine(tt, tmp_path)
    engine_losses(a, data, 4)
    with pytest.raises(FileNotFoundError, match="save_fp32_model: the directory of .*nodir.* does not exist"):
        a.save_fp32_model(str(tmp_path / "nodir" / "model.pt"))
    with pytest.raises(IsADirectoryError, match="is a directory: give a file path"):
        a.save_fp32_model(str(tmp_path))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile.*is a file"):
        a.save_fp32_model(str(tmp_path / "afile" / "model.pt"))
    path = str(tmp_path / "model.pt")
    written = a.save_fp32_model(path)
    assert written == 4 * sum(u.numel for u in a.units)
    sd = torch.load(path)  # plain torch.load, weights_only default
    plain = build("gpt2")
    plain.load_state_dict(sd)
    # Equal to the engine's master weights, and (fp32 working params) to what the model computes.
    for name, p in model.named_parameters():
        assert torch.equal(sd[name], p.detach()), name
    b = data[0]
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=b, labels=b).loss, model(input_ids=b, labels=b).loss)
    a.close()


def test_gathered_parameters_modify_and_write_back(torch_or_skip, tmp_path):
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    model, a = _engine(tt, tmp_path)
    w = model.transformer.h[0].mlp.c_fc.weight
    assert w.shape == (64, 256)
    with tt.zero.GatheredParameters([w]):
        assert float(w.abs().sum()) > 0
        before = w.detach().clone()
        w.data.mul_(0.5)
        w.data[0, 0] = 7.0
    with tt.zero.GatheredParameters(w):
        want = before * 0.5
        want[0, 0] = 7.0
        assert torch.equal(w.detach(), want)
    # The master weights changed too: the fp32 export sees the new values.
    a.save_fp32_model(str(tmp_path / "m.pt"))
    assert torch.equal(torch.load(str(tmp_path / "m.pt"))["transformer.h.0.mlp.c_fc.weight"], want)
    # An exception inside writes nothing back.
    with pytest.raises(KeyError):
        with tt.zero.GatheredParameters(w):
            w.data.fill_(1.0)
            raise KeyError("x")
    with tt.zero.GatheredParameters(w):
        assert torch.equal(w.detach(), want)
    # A value of another shape cannot go back into the unit: named, nothing written (it was torch's
    # "The size of tensor a (16384) must match ..."), and the parameter keeps its shape.
    with pytest.raises(ValueError, match=r"parameter \d+ of '.*c_fc' was set to shape \(3,\) .* but it is \(64, 256\)"):
        with tt.zero.GatheredParameters(w, modifier_rank=0):
            w.data = torch.zeros(3)
    assert w.shape == (64, 256)
    with tt.zero.GatheredParameters(w):
        assert torch.equal(w.detach(), want)
    with pytest.raises(TypeError, match="params must be a parameter or an iterable of parameters, got int"):
        tt.zero.GatheredParameters(5)
    with pytest.raises(TypeError, match=r"params\[1\] is a str, not a parameter"):
        tt.zero.GatheredParameters([w, "w"])
    a.close()


def test_reshard_source_from_python(tmp_path):
    """_tiermem.OptimizerStateReshard, the C++ re-partitioning load_checkpoint uses at another world
    size: one module of 20 elements saved over 2 ranks (alignment 4: shards of 12, old rank 1 holding
    elements 12-19 and 4 zeros of padding) read back whole at 1 rank; float32 arrays only; a missing
    old rank is named."""
    np = pytest.importorskip("numpy")
    from tiermem import _tiermem
    names = ["optimizer.master", "optimizer.exp_avg", "optimizer.exp_avg_sq"]
    for k in range(2):
        w = _tiermem.CheckpointWriter(str(tmp_path), k, 2, 1)
        part = np.zeros(12, dtype=np.float32)
        real = np.arange(12 * k, min(20, 12 * k + 12), dtype=np.float32)
        part[:len(real)] = real
        for i, name in enumerate(names):
            w.add_tensor(name, "host", part * (i + 1), "f32", [12])
        w.commit("{}")
    src = _tiermem.OptimizerStateReshard(str(tmp_path), 2, names, [20], 4, 1, 0)
    assert src.shard_numel == 20 and src.source_ranks() == [0, 1]
    got = [np.full(20, -1, dtype=np.float32) for _ in range(3)]
    for off in range(0, 20, 7):  # sub-groups not aligned to either layout
        n = min(7, 20 - off)
        src(off, *(g[off:off + n] for g in got))
    for i, g in enumerate(got):
        assert g.tolist() == [float(v * (i + 1)) for v in range(20)]
    with pytest.raises(ValueError, match="float32"):
        src(0, *(np.zeros(4, dtype=np.float64) for _ in range(3)))
    import shutil
    shutil.rmtree(tmp_path / "rank1")
    with pytest.raises(RuntimeError, match="rank1"):
        _tiermem.OptimizerStateReshard(str(tmp_path), 2, names, [20], 4, 1, 0)


def test_another_optimizers_state_is_refused(torch_or_skip, tmp_path):
    """AdamW's moments loaded into a Lion engine were taken for Lion's state, silently."""
    hf_or_skip()
    import tiermem.torch as tt
    _, a = _engine(tt, tmp_path)
    engine_losses(a, batches(1), 1)
    a.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    a.close()
    _, b = _engine(tt, tmp_path, optimizer={"type": "Lion", "params": {"lr": 1e-4}})
    with pytest.raises(ValueError, match=r"(?i)its optimizer state is AdamW's but this engine's optimizer is Lion"):
        b.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert b.global_steps == 0  # nothing loaded
    b.load_checkpoint(str(tmp_path / "ckpt"), tag="t", load_optimizer_states=False)  # the weights only
    b.close()
