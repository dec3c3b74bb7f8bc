"""Several ranks from PyTorch: torchrun starts 2 and 3 ranks (gloo on 127.0.0.1) of a script that
calls tiermem.torch.initialize; ZeroEngine's collectives run over torch.distributed. With the
global batch split evenly, the per-step global losses equal one rank's within 1e-5 relative:
stage 3 with both offloads on nvme at 2 and 3 ranks, stages 1 and 2 with offload cpu at 2 ranks.
A rank killed with SIGKILL mid-run makes the others exit non-zero, and the next run starts cleanly
in the same swap directory."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from torch_models import assert_rel_close, hf_or_skip

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, name, ranks, *args, env_extra=None, check=True, full=False):
    swap = tmp_path / f"swap-{name}"
    swap.mkdir(exist_ok=True)
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERMEM_COLLECTIVE_TIMEOUT_S="60", **(env_extra or {}))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if ranks == 1:
        cmd = [sys.executable, WORKER]
    else:
        if torchrun is None:
            pytest.skip("torchrun not found beside the interpreter or on PATH")
        cmd = [torchrun, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port",
               str(_port()), WORKER]
    cmd += ["--swap", str(swap), "--out", str(out), *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    took = time.monotonic() - t0
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        result = json.loads(out.read_text())
        return (result if full else result["losses"]), took
    return p, took, swap


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    hf_or_skip()
    losses, _ = _launch(tmp_path_factory.mktemp("one"), "one", 1)
    return losses


def _close(got, want, rel=1e-5):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rel * abs(b), f"step {i + 1}: {a} vs {b}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_stage3_nvme_ranks_match_one_rank(torch_or_skip, tmp_path, one_rank, ranks):
    got, _ = _launch(tmp_path, f"s3x{ranks}", ranks, full=True)
    _close(got["losses"], one_rank)
    # The all-gathers of the next unit were started ahead (prefetch_gather, async on gloo): the
    # loss equality above is with them in play.
    assert got["all_gathers_prefetched"] > 0, got
    assert got["all_gathers_prefetched"] <= got["all_gather_calls"], got


@pytest.mark.parametrize("stage,reduce_scatter", [(1, "native"), (2, "native"), (2, "all_reduce")])
def test_stages_1_and_2_cpu_offload_match(torch_or_skip, tmp_path, one_rank, stage, reduce_scatter):
    # all_reduce: the path for a gloo without reduce_scatter_tensor (a bucket all-reduced whole)
    got, _ = _launch(tmp_path, f"s{stage}{reduce_scatter}", 2, "--stage", str(stage), "--offload", "cpu",
                     env_extra={"TIERMEM_DIST_REDUCE_SCATTER": reduce_scatter})
    _close(got, one_rank)


def test_killed_rank_fails_the_others_and_the_next_run_starts_cleanly(torch_or_skip, tmp_path):
    hf_or_skip()
    p, took, swap = _launch(tmp_path, "kill", 2, env_extra={"TIERMEM_TEST_KILL_RANK1_AT_STEP": "3"}, check=False)
    assert p.returncode != 0
    assert took < 120, took  # within the collective timeout (60 s) and start-up, not a hang
    # torchrun stops the survivor and names the lost rank as the root cause.
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", p.stderr), p.stderr[-3000:]
    # The next run in the same swap directory starts and finishes.
    got, _ = _launch(tmp_path, "kill", 2)
    assert len(got) == 10


def test_killed_rank_is_named_by_the_survivor(torch_or_skip, tmp_path):
    """Ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a launcher that does not
    stop the others itself). Rank 1 is killed before step 3; rank 0's next collective fails within
    the collective timeout and its error names rank 1 and its pid."""
    hf_or_skip()
    swap = tmp_path / "swap"
    swap.mkdir()
    port = _port()
    procs = []
    for r in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TIERMEM_COLLECTIVE_TIMEOUT_S="30", RANK=str(r), WORLD_SIZE="2",
                   LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TIERMEM_TEST_KILL_RANK1_AT_STEP="3")
        procs.append(subprocess.Popen([sys.executable, WORKER, "--swap", str(swap), "--out", str(tmp_path / "o.json")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    t0 = time.monotonic()
    _, err = procs[0].communicate(timeout=300)
    took = time.monotonic() - t0
    procs[1].communicate(timeout=60)  # a zombie until now: rank 0 saw it as no longer running
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0
    assert took < 120, took
    assert re.search(rf"failed on rank 0 of 2: rank 1 \(pid {procs[1].pid}\) is no longer running", err), err[-3000:]


def test_resume_at_another_world_size(torch_or_skip, tmp_path):
    """Save at 2 ranks after step 4 and go on to step 8 (the continuation); resume that checkpoint
    at 3 and at 1 rank, and at 2 (bit for bit). Then save at 3 and resume at 2. The continuations
    at another size match within 1e-5 relative: the state is the same numbers, re-partitioned;
    only the gradient reduction's summation order over ranks differs (fp32)."""
    ckpt = tmp_path / "ckpt2"
    full, _ = _launch(tmp_path, "save2", 2, "--steps", "8", "--save-at", "4", "--ckpt", str(ckpt))
    cont = full[4:]
    same, _ = _launch(tmp_path, "r2", 2, "--steps", "4", "--resume", "--ckpt", str(ckpt))
    assert same == cont  # same world size: bit for bit
    for ranks in (3, 1):
        got, _ = _launch(tmp_path, f"r{ranks}", ranks, "--steps", "4", "--resume", "--ckpt", str(ckpt), full=True)
        _close(got["losses"], cont)
        _check_load_rss(got)
    ckpt3 = tmp_path / "ckpt3"
    full3, _ = _launch(tmp_path, "save3", 3, "--steps", "6", "--save-at", "3", "--ckpt", str(ckpt3))
    got, _ = _launch(tmp_path, "r3to2", 2, "--steps", "3", "--resume", "--ckpt", str(ckpt3), full=True)
    _close(got["losses"], full3[3:])
    _check_load_rss(got)


def test_optimizer_state_dict_at_two_ranks(torch_or_skip, tmp_path):
    """ZeroOptimizer.state_dict() at 2 ranks (a collective; rank 0 saves it) after step 4, and
    load_state_dict() on every rank of new engines: the continuation is bit for bit."""
    sd = tmp_path / "optimizer.pt"
    full, _ = _launch(tmp_path, "sd2", 2, "--steps", "8", "--save-at", "4", "--ckpt", str(sd), "--state-dict")
    same, _ = _launch(tmp_path, "sd2r2", 2, "--steps", "4", "--resume", "--ckpt", str(sd), "--state-dict")
    assert same == full[4:]


# The re-partitioning load streams: each rank's peak RSS may grow during load_checkpoint by at most
# its engine budgets (dist_worker's 2 MiB host + 512 KiB device) plus a stated allowance of 16 MiB
# (the checksum pass reads in chunks of up to 8 MiB; unpickled scheduler and RNG state; allocator
# slack). The baseline is the rank's own peak before the load (torch, the model, the engine).
LOAD_RSS_ALLOWANCE = (2 << 20) + (512 << 10) + (16 << 20)


def _check_load_rss(result):
    for rank, (before, after) in enumerate(result["load_rss"]):
        print(f"rank {rank}: max RSS {before / 2**20:.1f} MiB before load_checkpoint, {after / 2**20:.1f} MiB after "
              f"(+{(after - before) / 2**20:.2f} MiB; optimizer state {result['optimizer_state_bytes'] / 2**20:.2f} "
              "MiB per rank)")
        assert after - before <= LOAD_RSS_ALLOWANCE, (rank, before, after)


def test_rank_with_another_module_order_is_named(torch_or_skip, tmp_path):
    hf_or_skip()
    p, took, _ = _launch(tmp_path, "order", 2, "--steps", "2", env_extra={"TIERMEM_TEST_RANK1_ORDER": "1"},
                         check=False)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "the ranks gather different modules" in out, out[-3000:]
    assert "'transformer.h.0.attn.c_attn'" in out and "'transformer.h.0.mlp.c_fc'" in out, out[-3000:]
    assert took < 120, took


def test_load_state_dict_after_initialize_reaches_every_rank(torch_or_skip, tmp_path):
    """model.load_state_dict(...) on every rank after initialize (the HF Trainer's resume, PEFT's
    set_peft_model_state_dict): each rank's engine holds the loaded values (safe_get_full_fp32_param,
    a collective), and training from them at 2 ranks equals training from them at 1."""
    one = _launch(tmp_path, "lsd1", 1, "--steps", "2", "--load-model-state", full=True)[0]
    two = _launch(tmp_path, "lsd2", 2, "--steps", "2", "--load-model-state", full=True)[0]
    assert one["loaded_off"] == [0.0] and two["loaded_off"] == [0.0, 0.0]
    assert_rel_close(two["losses"], one["losses"], 1e-5)
