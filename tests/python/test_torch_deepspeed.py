"""tiermem.torch against DeepSpeed itself: the same HF GPT-2 (built from a small config, fixed
seed), the same token batches and the same ds_config (ZeRO stage 3, offload_param and
offload_optimizer both on nvme, fp32, clipping 1.0, AdamW), trained 20 steps by DeepSpeed 0.19.x
(DS_ACCELERATOR=cpu, gloo, one rank) and by ``tiermem.torch.initialize``: the loss of every step
must agree within 1e-4 relative.

Two runs: a constant learning rate (no ``scheduler`` section), and DeepSpeed's WarmupLR
(warmup_num_steps 5, warmup_max_lr 1e-3). For the second, the learning rate each optimizer step
used is compared first (DeepSpeed's ``engine.get_lr()`` read just before ``engine.step()``,
tiermem's the same way), so a schedule that is off by one iteration is named as such rather than
surfacing as a loss mismatch two steps later (DeepSpeed's optimizer step t runs at the lr of
iteration t - 2, iteration -1 being warmup_min_lr; tiermem.torch's DeepSpeedLR does the same). tiermem's run adds its own budgets
(``tiermem.host_budget_bytes`` 1 MiB, ``device_budget_bytes`` 256 KiB) so that it really pages
through NVMe; DeepSpeed does not read that key.

DeepSpeed runs in a subprocess (this file run as a script, ``--ds-worker``): torch.distributed
can be initialised only once per process and test_deepspeed_interop.py initialises it in the
pytest process. Its nvme offload needs DeepSpeed's async_io and cpu_adam ops, JIT-built by torch
once per machine (cached in ~/.cache/torch_extensions, a few minutes the first time): when they
cannot be imported or built the tests SKIP, naming why. Once the ops are cached both tests take
well under two minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the worker runs as a script; pytest's rootdir puts HERE there already
    sys.path.insert(0, HERE)

STEPS = 20
REL = 1e-4
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}}


def _config(nvme_dir: str, scheduler: dict | None) -> dict:
    """The one ds_config both runs get (DeepSpeed's nvme buffers sized for the small model: its
    default buffer_size, 1e8 elements x 5 buffers, would pin 2 GB)."""
    from torch_models import ds_config
    cfg = ds_config(nvme_dir, "nvme", gas=1, clip=1.0)
    cfg["zero_optimization"]["offload_param"].update({"buffer_count": 5, "buffer_size": 1 << 16,
                                                      "max_in_cpu": 0, "pin_memory": False})
    cfg["zero_optimization"]["offload_optimizer"].update({"buffer_count": 4, "pin_memory": False})
    cfg["zero_optimization"]["sub_group_size"] = 1 << 16
    cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                  "intra_op_parallelism": 1}
    cfg["steps_per_print"] = 1 << 30
    cfg["wall_clock_breakdown"] = False
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return cfg


def _train(engine, steps: int) -> tuple[list, list]:
    """Per step: the loss, and the learning rate the optimizer step is about to use."""
    from torch_models import batches
    data = batches(steps)
    losses, lrs = [], []
    for b in data:
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        lrs.append(float(engine.get_lr()[0]))
        engine.step()
        losses.append(loss.item())
    return losses, lrs


# ------------------------------------------------------------------------------ DeepSpeed (subprocess)

def _ds_probe() -> None:
    """Loads (building when not cached) the ops DeepSpeed's nvme offload needs; exit 3 with the
    reason on stdout when it cannot."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    except Exception as e:
        print(f"deepspeed cannot be imported: {type(e).__name__}: {e}")
        sys.exit(3)
    for builder in (AsyncIOBuilder(), CPUAdamBuilder()):
        try:
            if not builder.is_compatible(verbose=False):
                print(f"DeepSpeed's {builder.NAME} op is not compatible with this machine "
                      "(async_io needs libaio-dev)")
                sys.exit(3)
            builder.load(verbose=False)
        except SystemExit:
            raise
        except BaseException as e:
            print(f"DeepSpeed's {builder.NAME} op cannot be built or loaded: {type(e).__name__}: {e}")
            sys.exit(3)
    print(json.dumps({"deepspeed": deepspeed.__version__}))


def _ds_worker(nvme_dir: str, scheduler: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging
    import socket

    import deepspeed
    from deepspeed.utils import logger as ds_logger
    from torch_models import build
    ds_logger.setLevel(logging.WARNING)
    import transformers
    transformers.logging.set_verbosity_error()
    with socket.socket() as s:  # a free loopback port for the one-rank gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = build("gpt2")
    cfg = _config(nvme_dir, WARMUP if scheduler == "warmup" else None)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, lrs = _train(engine, STEPS)
    print(json.dumps({"losses": losses, "lrs": lrs, "deepspeed": deepspeed.__version__}))


def _run_ds(args: list, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, os.path.abspath(__file__)] + args, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=HERE)


# ------------------------------------------------------------------------------ tests

_PROBE: dict = {}


def _deepspeed_or_skip():
    if "result" not in _PROBE:
        # A first build of async_io and cpu_adam takes minutes on a small machine.
        try:
            r = _run_ds(["--ds-probe"], timeout=1800)
            _PROBE["result"] = (r.returncode, (r.stdout.strip().splitlines() or [""])[-1], r.stderr)
        except subprocess.TimeoutExpired:
            _PROBE["result"] = (3, "building DeepSpeed's async_io / cpu_adam ops took over 30 minutes", "")
    rc, line, err = _PROBE["result"]
    if rc == 3:
        pytest.skip(line)
    if rc != 0:
        raise AssertionError(f"DeepSpeed's op probe failed (exit {rc}): {line}\n{err[-4000:]}")


def _deepspeed_run(tmp_path, scheduler: str) -> dict:
    d = tmp_path / "ds"
    d.mkdir()
    r = _run_ds(["--ds-worker", str(d), scheduler], timeout=900)
    assert r.returncode == 0, f"DeepSpeed's run failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tiermem_run(tmp_path, scheduler: str) -> tuple[list, list]:
    import tiermem.torch as tt
    from torch_models import build
    d = tmp_path / "tm"
    d.mkdir()
    model = build("gpt2")
    cfg = _config(str(d), WARMUP if scheduler == "warmup" else None)
    # tiermem's own budgets, far below the state (1.9 MiB), so that every step pages through NVMe
    # (with its defaults this model would stay in the host tier); DeepSpeed has no such key.
    cfg["tiermem"] = {"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"}
    engine, *_ = tt.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        losses, lrs = _train(engine, STEPS)
        st = engine.stats()
        assert st["param_home"] == "nvme" and st["optimizer_home"] == "nvme"
        assert st["nvme_read_bytes"] > 0 and st["nvme_written_bytes"] > 0
        assert engine.global_steps == STEPS
    finally:
        engine.close()
    return losses, lrs


def _compare(want: dict, got_losses: list, got_lrs: list) -> None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(got_losses, want["losses"]))
    print(f"losses: largest relative difference to DeepSpeed over {len(got_losses)} steps {worst:.3g}")
    for i, (a, b) in enumerate(zip(got_lrs, want["lrs"])):
        assert abs(a - b) <= 1e-12 + 1e-9 * abs(b), (
            f"optimizer step {i + 1}: tiermem's lr {a!r} != DeepSpeed {want['deepspeed']}'s lr {b!r}\n"
            f"  tiermem   {got_lrs[:8]}\n  DeepSpeed {want['lrs'][:8]}")
    assert len(got_losses) == len(want["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(got_losses, want["losses"])):
        assert abs(a - b) <= REL * abs(b), (f"step {i + 1}: tiermem loss {a} vs DeepSpeed {b} "
                                            f"(rel {abs(a - b) / abs(b):.3g} > {REL})")


def test_losses_equal_deepspeed_constant_lr(torch_or_skip, tmp_path):
    from torch_models import hf_or_skip
    hf_or_skip()
    _deepspeed_or_skip()
    want = _deepspeed_run(tmp_path, "none")
    got_losses, got_lrs = _tiermem_run(tmp_path, "none")
    _compare(want, got_losses, got_lrs)


def test_losses_equal_deepspeed_warmup_lr(torch_or_skip, tmp_path):
    from torch_models import hf_or_skip
    hf_or_skip()
    _deepspeed_or_skip()
    want = _deepspeed_run(tmp_path, "warmup")
    got_losses, got_lrs = _tiermem_run(tmp_path, "warmup")
    _compare(want, got_losses, got_lrs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ds-probe"]:
        _ds_probe()
    elif sys.argv[1:2] == ["--ds-worker"]:
        _ds_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: test_torch_deepspeed.py --ds-probe | --ds-worker NVME_DIR none|warmup (run it with pytest)")
