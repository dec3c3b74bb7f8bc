"""tiermem.torch refuses what it cannot run with a Python exception naming the thing, and a
refused start writes nothing to the swap directory."""

import os

import pytest

from torch_models import batches, bf16_master_reference, build, ds_config, hf_or_skip


def _small(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _assert_nothing_written(path):
    assert not os.path.exists(path) or os.listdir(path) == [], os.listdir(path)


def test_parameters_on_two_devices(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    m[2].to("meta")
    with pytest.raises(ValueError, match=r"several devices: cpu \(e.g. '0.weight'\), meta \(e.g. '2.weight'\)"):
        tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    _assert_nothing_written(tmp_path / "swap")


def test_integer_parameter(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    m[0].steps = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"parameter '0.steps' is torch.int64.*register_buffer"):
        tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    _assert_nothing_written(tmp_path / "swap")


def test_initialize_twice(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path / "a", "cpu"))
    with pytest.raises(RuntimeError, match="already managed by a tiermem engine"):
        tt.initialize(model=m, config=ds_config(tmp_path / "b", "nvme"))
    _assert_nothing_written(tmp_path / "b")
    engine.close()


def test_step_before_any_backward(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    engine, optimizer, _, _ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu"))
    with pytest.raises(RuntimeError, match="before any backward"):
        engine.step()
    with pytest.raises(RuntimeError, match="before any backward"):
        optimizer.step()
    # After a backward both work.
    loss = m(torch.ones(4, 8)).sum()
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    with pytest.raises(RuntimeError, match=r"no backward\(\) since the last step\(\)"):
        engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 1
    engine.close()
    # With accumulation, a second step() after one backward() stepped the optimizer on half of the
    # step's micro-batches.
    engine, *_ = tt.initialize(model=_small(torch), config=ds_config(tmp_path, "cpu", gas=2))
    engine.backward(engine(torch.ones(4, 8)).sum())
    engine.step()
    with pytest.raises(RuntimeError, match=r"no backward\(\) since the last step\(\)"):
        engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 1
    engine.backward(engine(torch.ones(4, 8)).sum())
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 2
    engine.close()


def test_unknown_offload_device(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / "swap", "nvme")
    cfg["zero_optimization"]["offload_param"]["device"] = "tape"
    with pytest.raises(ValueError, match=r"zero_optimization.offload_param.device.*tape"):
        tt.initialize(model=_small(torch), config=cfg)
    _assert_nothing_written(tmp_path / "swap")


def test_a_nan_in_a_config_dict_names_its_key(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / "swap", "nvme")
    cfg["optimizer"]["params"]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"config key 'optimizer.params.lr' = nan: must be a finite number"):
        tt.initialize(model=_small(torch), config=cfg)
    cfg = ds_config(tmp_path / "swap", "nvme")
    cfg["optimizer"]["params"]["betas"] = [0.9, float("inf")]
    with pytest.raises(ValueError, match=r"'optimizer.params.betas\[1\]' = inf"):
        tt.initialize(model=_small(torch), config=cfg)
    _assert_nothing_written(tmp_path / "swap")


def test_budget_below_the_minimum_names_the_key(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / "swap", "nvme", tiermem={"device_budget_bytes": "1KiB"})
    with pytest.raises(ValueError, match=r"tiermem.device_budget_bytes"):
        tt.initialize(model=_small(torch), config=cfg)
    _assert_nothing_written(tmp_path / "swap")


def test_a_host_or_sim_device_budget_above_the_machines_memory_is_warned_about(torch_or_skip, tmp_path, capfd):
    torch = torch_or_skip
    import tiermem.torch as tt
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cfg = ds_config(tmp_path / "swap", "cpu", tiermem={"host_budget_bytes": 2 * phys})
    engine, *_ = tt.initialize(model=_small(torch), config=cfg)
    err = capfd.readouterr().err
    assert "tiermem.host_budget_bytes" in err and "more than this machine's memory" in err, err
    loss = engine(torch.randn(2, 8)).sum()  # it still trains
    engine.backward(loss)
    engine.step()
    engine.close()
    # So is a simulated device's budget beyond it: that device allocates from the same memory.
    cfg = ds_config(tmp_path / "swap3", "cpu", tiermem={"device_budget_bytes": 2 * phys})
    engine, *_ = tt.initialize(model=_small(torch), config=cfg)
    err = capfd.readouterr().err
    assert "tiermem.device_budget_bytes" in err and "simulated device allocates from" in err, err
    engine.close()
    # One the address space cannot hold is refused, naming the key.
    cfg = ds_config(tmp_path / "swap2", "cpu", tiermem={"host_budget_bytes": "100TiB"})
    with pytest.raises(ValueError, match=r"config key 'tiermem.host_budget_bytes' = \d+: the host pool cannot reserve"):
        tt.initialize(model=_small(torch), config=cfg)


def test_a_half_model_under_an_fp32_config_is_said_to_become_fp32(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    with pytest.warns(UserWarning, match=r"model's float16 parameters become float32 and its inputs must be float32"):
        engine, *_ = tt.initialize(model=_small(torch).half(), config=ds_config(tmp_path / "swap", "cpu"))
    assert engine.module(torch.randn(2, 8)).dtype == torch.float32
    engine.close()
    # float64 has no mode of its own to point to.
    with pytest.warns(UserWarning, match=r"float64 parameters become float32 .*float32, bfloat16 or float16 only"):
        engine, *_ = tt.initialize(model=_small(torch).double(), config=ds_config(tmp_path / "swap", "cpu"))
    engine.close()


def test_nvme_path_that_is_a_file(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem
    import tiermem.torch as tt
    f = tmp_path / "a_file"
    f.write_text("mine")
    with pytest.raises(tiermem.IoError) as e:
        tt.initialize(model=_small(torch), config=ds_config(f, "nvme"))
    msg = str(e.value)
    assert "is a file, not a directory" in msg and "nvme_path" in msg, msg
    assert "at offset" not in msg, msg  # a mkdir has no file position
    assert f.read_text() == "mine"


def test_second_engine_on_the_directory_of_an_open_one(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    engine, *_ = tt.initialize(model=_small(torch), config=ds_config(tmp_path / "swap", "nvme"))
    with pytest.raises(RuntimeError, match=r"in use by another engine in this process \(pid %d" % os.getpid()):
        tt.initialize(model=_small(torch), config=ds_config(tmp_path / "swap", "nvme"))
    engine.close()
    second, *_ = tt.initialize(model=_small(torch), config=ds_config(tmp_path / "swap", "nvme"))  # free once closed
    second.close()


def test_optimizer_argument_and_missing_config(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    with pytest.raises(ValueError, match="optimizer=None"):
        tt.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=ds_config())
    with pytest.raises(ValueError, match="no config"):
        tt.initialize(model=m)
    with pytest.raises(ValueError, match="cannot read config file"):
        tt.initialize(model=m, config=str(tmp_path / "missing.json"))
    bad = tmp_path / "dup.json"
    bad.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ValueError, match=r"zero_optimization.stage' is given twice in .*dup.json"):
        tt.initialize(model=m, config=str(bad))


def test_bf16_within_tolerance_of_a_bf16_reference(torch_or_skip, tmp_path):
    """The reference: the plain model in bf16 with fp32 master copies stepped by torch.optim.AdamW
    and copied back (round to nearest even) after each step, as mixed-precision training does.
    tiermem's AdamW is the same formula on the same fp32 masters; the bf16 working copies and the
    forward/backward are the same, so the losses agree to within bf16's rounding of the updated
    weights: 2e-3 relative over 10 steps (measured: 5.2e-5)."""
    torch = torch_or_skip
    hf_or_skip()
    import tiermem.torch as tt
    data = batches(10)
    want = bf16_master_reference(build("gpt2"), data)
    model = build("gpt2")
    cfg = ds_config(tmp_path, "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    cfg["bf16"] = {"enabled": True}
    engine, *_ = tt.initialize(model=model, config=cfg)
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16  # the working dtype
    got = []
    for b in data:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"bf16: worst relative loss difference {worst:.3g}")
    assert worst <= 2e-3, (got, want)
    engine.close()


def test_misuse_after_initialize_is_named(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import copy
    import tiermem.torch as tt
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    w = m[0].weight
    # An optimizer step inside GatheredParameters (its parameters are a copy the step would miss).
    with tt.zero.GatheredParameters(list(m.parameters())):
        engine.backward(m(torch.ones(4, 8)).sum())
        with pytest.raises(RuntimeError, match="inside zero.GatheredParameters"):
            engine.step()
    engine.step()  # outside it works
    # Nested scopes write the change back once.
    with tt.zero.GatheredParameters(w):
        with tt.zero.GatheredParameters(w):
            w.data.mul_(0)
    with tt.zero.GatheredParameters(w):
        assert float(w.detach().abs().sum()) == 0.0
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
        copy.deepcopy(m)
    held_row = m[0].weight.data[2]  # a view held from before close
    engine.close()
    with pytest.raises(RuntimeError, match="engine that has been closed"):
        m(torch.ones(4, 8))
    # Reading a closed model's values gave zeros without a word (a state_dict saved after close,
    # a second initialize training from zeros); its shapes still answer.
    assert m[0].weight.shape == (8, 8) and m[0].weight.dtype == torch.float32
    # p.data too (an EMA or export reading p.data after close computed NaN without a word).
    assert m[0].weight.data.shape == (8, 8) and m[0].weight.data.dtype == torch.float32
    # print(p) and a debugger's view say what it is (raised before: a repr is no read of values).
    assert "shape (8, 8), torch.float32, whose engine was closed: no values" in repr(m[0].weight)
    assert "whose engine was closed: no values" in repr(m[0].weight.detach())
    assert "whose engine was closed: no values" in repr(held_row) and held_row.shape == (8,)
    reads = (m.state_dict, lambda: m[0].weight.sum(), lambda: tt.initialize(model=m, config=ds_config(tmp_path / "s2", "nvme")),
             lambda: m[0].weight.data.sum(), lambda: m[0].weight.data.clone(), lambda: m[0].weight.data.tolist(),
             lambda: m[0].weight.data.numpy(), lambda: m[0].weight.data + 0, lambda: m[0].weight.data.detach().sum(),
             lambda: torch.equal(m[0].weight.data, m[0].weight.data), lambda: m[0].weight.data.data.mean())
    for read in reads:
        with pytest.raises(RuntimeError, match="engine that has been closed, and their values went with it"):
            read()
    with pytest.raises(RuntimeError, match="the engine was closed"):
        engine.stats()
    with pytest.raises(RuntimeError, match="the engine was closed"):
        engine.get_lr()


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment: a world size is at least 1"),
    ({"WORLD_SIZE": "-1"}, "WORLD_SIZE=-1"),
    ({"WORLD_SIZE": "1", "RANK": "1"}, r"RANK=1 in the environment is no rank of WORLD_SIZE=1 \(ranks 0 .. 0\)"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "RANK=5 .* WORLD_SIZE=2"),
    ({"WORLD_SIZE": "1", "RANK": "abc"}, "RANK='abc' in the environment is not an integer"),
])
def test_launcher_variables_that_name_no_rank_are_refused_at_once(torch_or_skip, tmp_path, monkeypatch, env, named):
    # RANK 5 of 2 waited for peers that never came (a TCPStore timeout minutes later); RANK 1 of 1,
    # WORLD_SIZE 0 or -1 ran silently as one rank; WORLD_SIZE=abc said only "invalid literal".
    torch = torch_or_skip
    import tiermem.torch as tt
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The variables count only without a process group; one an earlier test of this process made
    # (the HF Trainer's, DeepSpeed's) would answer instead.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    m = _small(torch)
    with pytest.raises(ValueError, match=named):
        tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())


def test_failed_initialize_leaves_the_model_as_it_was(torch_or_skip, tmp_path):
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    # Room for the first modules' state only: registration fails part-way.
    cfg = ds_config(tmp_path / "swap", "nvme", tiermem={"swap_initial_bytes": "4KiB", "swap_max_bytes": "8KiB"})
    with pytest.raises((MemoryError, ValueError)):
        tt.initialize(model=m, config=cfg)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_failed_initialize_gives_a_host_memory_init_store_its_values_back(torch_or_skip, tmp_path, monkeypatch):
    """Built under zero.Init with nothing on NVMe, each unit's values are freed once registered
    (issue 57); a later unit that fails gives every freed value back from the engine, bit for bit,
    and the model then initializes and trains as one that never failed."""
    torch = torch_or_skip
    import tiermem.torch as tt
    from tiermem.torch import _init_store
    cfg = ds_config(tmp_path / "swap", "cpu")
    given_back = []
    give_back = _init_store.InitStore.give_back
    monkeypatch.setattr(_init_store.InitStore, "give_back",
                        lambda self, p, values: (given_back.append(tuple(p.shape)), give_back(self, p, values)))

    def build_stored():
        torch.manual_seed(0)
        with tt.zero.Init(config=cfg):
            m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        m[1].requires_grad_(False)  # a frozen unit and a trained one
        return m
    m = build_stored()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m[3].weight.data = torch.zeros(3)  # the last unit fails to register, the first two are in the engine
    with pytest.raises(ValueError, match=r"was given \.data of \(3,\)"):
        tt.initialize(model=m, config=cfg)
    assert sorted(given_back) == [(8,), (8,), (8, 8), (8, 8)], given_back
    for n, p in m.named_parameters():
        if not n.startswith("3."):
            assert p.dtype == before[n].dtype and torch.equal(p.detach(), before[n]), n
    m[3].weight.data = before["3.weight"].clone()
    engine, *_ = tt.initialize(model=m, config=cfg)
    x = torch.ones(4, 8)
    got = engine(x).detach()
    engine.close()
    ref = build_stored()
    ref_engine, *_ = tt.initialize(model=ref, config=cfg)
    assert torch.equal(got, ref_engine(x).detach())
    ref_engine.close()


def test_an_interrupted_initialize_gives_the_models_own_tensors_back(torch_or_skip, tmp_path, monkeypatch):
    """With every home in memory (offload cpu), a model built without zero.Init gives each unit's
    tensors up once the unit is registered (issue 57: the model and the engine's homes were held
    whole at once, 1.4x the steps' RSS). An initialize interrupted part-way (Ctrl-C while the last
    unit registers) gives them back from the engine, bit for bit, in their dtype; the model then
    initializes and computes as one never interrupted."""
    torch = torch_or_skip
    import tiermem.torch as tt
    from tiermem.torch import _unit
    from tiermem.torch._params import holds_placeholder, raw_data
    cfg = ds_config(tmp_path / "swap", "cpu")

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        m[1].requires_grad_(False)  # a frozen unit and trained ones
        return m
    m = build()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    flat_values = _unit.Unit.flat_values
    lent = []

    def interrupted(self, out=None):
        if self.name.startswith("3"):
            lent.extend(n for n, p in m.named_parameters() if holds_placeholder(raw_data(p)))
            raise KeyboardInterrupt
        return flat_values(self, out)
    monkeypatch.setattr(_unit.Unit, "flat_values", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tt.initialize(model=m, config=cfg)
    assert sorted(lent) == ["0.bias", "0.weight", "1.bias", "1.weight"], f"not freed before the last unit: {lent}"
    for n, p in m.named_parameters():
        assert p.dtype == before[n].dtype and torch.equal(p.detach(), before[n]), n
    monkeypatch.setattr(_unit.Unit, "flat_values", flat_values)
    engine, *_ = tt.initialize(model=m, config=cfg)
    x = torch.ones(4, 8)
    got = engine(x).detach()
    engine.close()
    ref_engine, *_ = tt.initialize(model=build(), config=cfg)
    assert torch.equal(got, ref_engine(x).detach())
    ref_engine.close()


def test_the_banner_says_where_the_parameters_are_at_each_stage(torch_or_skip, tmp_path, capfd):
    """Below stage 3 the parameters are not partitioned: the banner said "params -> device" on a
    CPU run whose parameters stay the model's own tensors in host memory."""
    torch = torch_or_skip
    import tiermem.torch as tt
    for stage, says in ((2, "params -> the model's own (not partitioned below stage 3)"), (3, "params -> device")):
        engine, *_ = tt.initialize(model=_small(torch), config=ds_config(tmp_path, "none", stage=stage))
        err = capfd.readouterr().err
        assert f"stage {stage}: {says}, optimizer -> " in err, err
        engine.close()


def test_a_parameter_replaced_after_initialize_is_refused(torch_or_skip, tmp_path):
    """After initialize, `p.data = t` of the parameter's shape and dtype is a write that reaches the
    engine; one of another shape, or `module.half()`, is refused at the call with nothing changed. A
    Parameter object put in the registered one's place would never be trained: the next gather
    puts the registered one back and says so."""
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu"))
    m[0].weight.data = torch.full((8, 8), 3.0)
    with tt.zero.GatheredParameters([m[0].weight]):
        assert torch.equal(m[0].weight.detach(), torch.full((8, 8), 3.0))
    engine.close()
    for change, error, says in (
            (lambda m: setattr(m[0].weight, "data", torch.zeros(3)), ValueError, r"cannot be given \.data of \(3,\)"),
            (lambda m: m.half(), RuntimeError, r"to torch\.float16 after initialize is refused, nothing was changed"),
            (lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(8, 8))), RuntimeError,
             r"was replaced by another object .* which is undone")):
        m = _small(torch)
        engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu"))
        registered = m[0].weight
        with tt.zero.GatheredParameters([m[0].weight]):
            before = m[0].weight.detach().clone()
        with pytest.raises(error, match=says):
            change(m)
            engine(torch.ones(4, 8))
        # The engine's values, shapes and dtype stand, and it trains on.
        assert [p.dtype for p in m.parameters()] == [torch.float32] * 4 and m[0].weight.shape == (8, 8)
        assert m[0].weight is registered
        with tt.zero.GatheredParameters([m[0].weight]):
            assert torch.equal(m[0].weight.detach(), before)
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
        engine.close()
    # Inside GatheredParameters the change is written back and kept.
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu"))
    with tt.zero.GatheredParameters([m[0].weight, m[0].bias], modifier_rank=0):
        m[0].weight.data.fill_(0.0)
        m[0].bias.data.fill_(0.0)
    engine(torch.ones(4, 8))  # a forward after the write-back runs
    with tt.zero.GatheredParameters([m[0].weight]):
        assert torch.count_nonzero(m[0].weight) == 0
    engine.close()


def test_moving_the_model_to_another_device_after_initialize_is_refused(torch_or_skip, tmp_path):
    """`model.to("meta")` (or `engine.to`, a submodule's `.to`, `to_empty`) after initialize was
    accepted: modules of one parameter were left holding meta parameters and buffers, and the next
    steps failed with torch's device error (or one unit at a time with a message about a replaced
    parameter). It is refused before anything moves; the same device is a no-op."""
    torch = torch_or_skip
    import tiermem.torch as tt
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 2))
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    params = list(m.parameters())
    for move in (lambda: m.to("meta"), lambda: engine.to("meta"), lambda: m[3].to(device="meta"),
                 lambda: m.to_empty(device="meta")):
        with pytest.raises(RuntimeError, match=r"to meta after initialize is refused, nothing was moved.*"
                                               r"before initialize.*save_fp32_model"):
            move()
        assert list(m.parameters()) == params
        assert {t.device.type for t in list(m.parameters()) + list(m.buffers())} == {"cpu"}
    assert engine.to("cpu") is engine and m.to(torch.device("cpu")) is m
    for _ in range(2):
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
    assert engine.global_steps == 2
    engine.close()


def test_moving_a_module_without_parameters_is_refused_with_a_true_reason(torch_or_skip, tmp_path):
    """`BatchNorm1d(affine=False).to("meta")` after initialize was refused with "its parameters are
    in the tiermem engine", for a module that has none: the reason names the model's parameters."""
    torch = torch_or_skip
    import tiermem.torch as tt
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8, affine=False), torch.nn.Linear(8, 2))
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
    with pytest.raises(RuntimeError, match=r"moving BatchNorm1d \('1'\) to meta after initialize is refused, nothing "
                                           r"was moved: the model's parameters are in the tiermem engine"):
        m[1].to("meta")
    assert {b.device.type for b in m.buffers()} == {"cpu"}
    engine.backward(engine(torch.ones(4, 8)).sum())
    engine.step()
    engine.close()


def test_a_move_that_keeps_the_device_leaves_the_engine_as_it_is(torch_or_skip, tmp_path, capfd):
    """`model.to("cpu:0")`, `model.to(torch.device("cpu", 0))` and `model.to_empty(device="cpu")`
    after initialize (the device the model computes on, spelled another way) were refused: torch's
    `_apply` gathered each parameter and left the gathered memory in `.data`, which the next gather
    undid with "had its .data replaced ... after initialize", after an "access trace diverged"
    warning. They are accepted and change nothing of the parameters (to_empty keeps the engine's
    values): the losses after them equal those of a run without them, bit for bit, with no warning.
    A conversion of the buffers alone (`.float()` of an fp32 model with an fp64 buffer) converts it."""
    torch = torch_or_skip
    import tiermem.torch as tt

    def run(moves):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        m[2].register_buffer("scale", torch.ones(3, dtype=torch.float64))  # read by no forward
        engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path / "swap", "nvme"))
        params = list(m.parameters())
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            if step in moves:
                with tt.zero.GatheredParameters(params):
                    before = [p.detach().clone() for p in params]
                assert moves[step](m, engine) in (m, engine)
                assert list(m.parameters()) == params
                with tt.zero.GatheredParameters(params):
                    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
            loss = engine(torch.randn(4, 8, generator=g)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return m, losses

    _, want = run({})
    capfd.readouterr()
    m, got = run({1: lambda m, e: m.to("cpu:0"), 2: lambda m, e: m.to(torch.device("cpu", 0)),
                  3: lambda m, e: m.to_empty(device="cpu")})
    assert got == want
    err = capfd.readouterr().err
    assert "access trace diverged" not in err and "had its .data replaced" not in err, err
    m, got = run({1: lambda m, e: e.to("cpu:0"), 2: lambda m, e: m.float()})
    assert got == want and m[2].scale.dtype == torch.float32


def test_a_loss_that_reaches_no_parameter_is_named_at_backward(torch_or_skip, tmp_path):
    """`engine.backward(torch.tensor(1.0, requires_grad=True))` counted no backward, and the next
    step() was refused as "called before any backward()", which the user had just called. backward
    says the loss reached none of the model's parameters, and the engine stays usable."""
    torch = torch_or_skip
    import tiermem.torch as tt
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu", gas=2))
    x = torch.ones(3, requires_grad=True)
    for loss, how in ((torch.tensor(1.0, requires_grad=True), "it is a leaf tensor.*nothing was run"),
                      (torch.tensor(1.0), "it does not require grad.*nothing was run"),  # was torch's own message
                      ((x * 2).sum(), "added no gradient and is not counted"),
                      (m(torch.ones(4, 8)).sum().detach().requires_grad_(), "it is a leaf tensor")):
        with pytest.raises(RuntimeError, match=r"TiermemEngine.backward: the loss reached none of the model's "
                                               r"trainable parameters: compute it from the output of engine.*" + how):
            engine.backward(loss)
    with pytest.raises(RuntimeError, match="before any backward.. that reached the model's trainable parameters"):
        engine.step()
    assert engine.micro_steps == 0
    for _ in range(2):
        engine.backward(engine(torch.ones(4, 8)).sum())
        engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 2
    engine.close()


def test_the_host_minimum_says_what_it_adds_up(torch_or_skip, tmp_path):
    """The host budget's minimum lists its parts; with one fp32 copy (the masters kept in the
    working shards) it named the homes before that saving, so its parts added up to more than its
    total (found by a helper trying the README as a new user). The saving is named now, and the
    minimum it names trains."""
    torch = torch_or_skip
    import re
    import tiermem.torch as tt
    m = _small(torch)
    cfg = ds_config(tmp_path, "cpu", tiermem={"host_budget_bytes": "4KiB"})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every module stored: one fp32 copy
    with pytest.raises(ValueError, match=r"of fp32 master weights kept once, in the working shards") as err:
        tt.initialize(model=m, config=cfg)
    need = int(re.search(r"\((\d+) bytes\) this model needs", str(err.value)).group(1))
    cfg["tiermem"]["host_budget_bytes"] = need
    engine, *_ = tt.initialize(model=m, config=cfg)
    engine.backward(engine(torch.ones(4, 8)).sum())
    engine.step()
    engine.close()


def test_a_swap_directory_that_cannot_be_made_is_named_as_such(torch_or_skip, tmp_path):
    """An nvme_path on a filesystem where no directory can be made (/proc) was refused as "its
    filesystem has 0 B free" by initialize, and zero.Init raised os.mkdir's bare FileNotFoundError:
    both now say the directory cannot be made, and zero.Init names the key that gave it."""
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path, "nvme")
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key]["nvme_path"] = "/proc/tiermem-no-such-dir"
    with pytest.raises(OSError) as err:
        tt.initialize(model=_small(torch), config=cfg)
    assert "free" not in str(err.value) and "/proc/tiermem-no-such-dir" in str(err.value), str(err.value)
    with pytest.raises(OSError, match=r"zero\.Init: cannot make the Init store under "
                                      r"zero_optimization\.offload_param\.nvme_path '/proc/tiermem-no-such-dir'"):
        with tt.zero.Init(config=cfg):
            torch.nn.Linear(4, 4)


def _interrupt_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("offload, budgets", [("none", None), ("nvme", {"device_budget_bytes": 8192, "host_budget_bytes": 65536})])
def test_a_keyboard_interrupt_in_a_forward_hook_leaves_later_steps_exact(torch_or_skip, tmp_path, offload, budgets):
    """torch runs no post-forward hook for a BaseException: a Ctrl-C landing in a user's
    pre-forward hook (a notebook cell interrupted, then run again) left the module's unit gathered.
    With the parameters on the device every later step failed ("pinned on device"); on NVMe at
    tight budgets the next forwards computed with the weights of before the step, the losses off
    from the next step on, without a word (found by a helper trying the product as a new user). The
    model's next forward, or step(), now drops what the interrupted forward held."""
    torch = torch_or_skip
    import tiermem.torch as tt
    cfg = ds_config(tmp_path / "swap", offload)
    if budgets:
        cfg["tiermem"] = budgets
    torch.manual_seed(1)
    data = [(torch.randn(2, 16), torch.randn(2, 4)) for _ in range(6)]

    def train(interrupt_at, write_at=2):
        m = _interrupt_model(torch)
        engine, *_ = tt.initialize(model=m, config=cfg)
        fire = [False]

        def hook(module, args):
            if fire[0]:
                fire[0] = False
                raise KeyboardInterrupt
        m[2].register_forward_pre_hook(hook)
        losses = []
        for i, (x, y) in enumerate(data):
            if i == interrupt_at:  # interrupted before the micro-batch, which is then run again
                fire[0] = True
                with pytest.raises(KeyboardInterrupt):
                    engine(x)
            if i == write_at:  # a write between steps (weight averaging): it reached the working copy alone
                torch._foreach_mul_([p.data for p in m.parameters()], 0.5)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            if i == interrupt_at + 1:  # interrupted between backward and step: step() itself recovers
                fire[0] = True
                with pytest.raises(KeyboardInterrupt), torch.no_grad():
                    engine(x)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses
    want = train(-5)
    assert train(2) == want
    assert train(2, write_at=-5) != want  # the write is seen: the runs differ without it


def test_a_call_on_many_parameters_that_do_not_fit_together_says_so(torch_or_skip, tmp_path, monkeypatch):
    """torch._foreach_norm(list(model.parameters())) holds every unit gathered at once; where the
    budgets cannot hold them together the engine's out-of-memory error said "a bug: please report"
    (found by a helper checking user flows). It now says what the call did and what to do. The
    engine's error is simulated here for the second unit gathered; the model is unchanged after it."""
    torch = torch_or_skip
    import tiermem.torch as tt
    from tiermem.torch import _unit
    m = _small(torch)
    engine, *_ = tt.initialize(model=m, config=ds_config(tmp_path, "cpu"))
    before = [p.detach().clone() for p in m.parameters()]
    gather = _unit.Unit.gather
    seen = []

    def short_of_memory(self, phase=None, copy=False):
        seen.append(self.index)
        if len(seen) == 2:
            raise MemoryError("out of device memory (simulated)")
        return gather(self, phase, copy)
    monkeypatch.setattr(_unit.Unit, "gather", short_of_memory)
    for call in (lambda: torch._foreach_norm(list(m.parameters())),
                 lambda: _no_grad_foreach_mul(torch, list(m.parameters()))):
        seen.clear()
        with pytest.raises(MemoryError, match=r"on the parameters of \d+ engine modules holds them all gathered at once "
                                              r"\(\d+ bytes\).*call it on fewer parameters at a time.*simulated"):
            call()
    monkeypatch.setattr(_unit.Unit, "gather", gather)
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.detach(), b)
    engine.close()


def _no_grad_foreach_mul(torch, params):
    with torch.no_grad():
        torch._foreach_mul_(params, 0.5)
