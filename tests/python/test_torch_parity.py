"""tiermem.torch against plain PyTorch at the gradient level (issue 55's differential matrix).

Each cell trains the same model from identical initial weights (deep-copied after PEFT's random LoRA
init) on the same data, plain PyTorch with torch.optim.AdamW and tiermem.torch with the same
hyper-parameters and clipping, and compares at every optimizer step the loss, every trainable
parameter's gradient (`utils.safe_get_full_grad` between backward and step against the plain `p.grad`
summed over the micro-batches) and every trainable parameter after the update
(`utils.safe_get_full_fp32_param`). The harness is parity.py; its TOL says the tolerances and why.

`make test` runs a covering sample: every value of every axis at least once (families llama, gpt2,
mixtral (MoE), t5 (encoder-decoder); full / PEFT LoRA / partly frozen; checkpointing none, reentrant,
non-reentrant and transformers' default; fp32, bf16 autocast, the bf16 config; accumulation 1 and 3;
offload none, cpu, nvme at budgets that page every step; the own loop, the HF Trainer, TRL's SFT, DPO
and GRPO trainers; 1 and 2 ranks). The full cross product (parity.full_matrix()):

    cd tests/python && TIERMEM_PARITY=full python -m pytest -q test_torch_parity.py

`TIERMEM_PARITY_REPORT=<file.jsonl>` appends one line per cell (its id and worst differences)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from parity import DIST_CELL, Cell, check, full_matrix, run_cell, run_in_child, summary
from torch_models import hf_or_skip

FULL = os.environ.get("TIERMEM_PARITY") == "full"

# The covering sample: each row is (family, trains, ckpt, precision, gas, offload, entry).
FAST = [
    Cell("llama", "lora", "nonreentrant", "fp32", 1, "nvme", "loop"),
    Cell("llama", "lora", "default", "fp32", 3, "cpu", "loop"),
    Cell("gpt2", "lora", "nonreentrant", "fp32", 1, "none", "loop"),
    Cell("gpt2", "full", "reentrant", "autocast", 3, "none", "loop"),
    Cell("mixtral", "frozen", "nonreentrant", "fp32", 1, "nvme", "loop"),
    Cell("mixtral", "lora", "none", "autocast", 1, "none", "loop"),
    Cell("mixtral", "full", "reentrant", "fp32", 3, "cpu", "loop"),
    Cell("t5", "lora", "reentrant", "bf16", 1, "cpu", "loop"),
    Cell("t5", "full", "default", "fp32", 3, "nvme", "loop"),
    Cell("gpt2", "frozen", "default", "bf16", 3, "nvme", "loop"),
    Cell("llama", "frozen", "reentrant", "bf16", 1, "none", "loop"),
    Cell("llama", "full", "none", "fp32", 1, "nvme", "trainer"),
    Cell("gpt2", "lora", "nonreentrant", "autocast", 3, "nvme", "trainer"),
    Cell("t5", "frozen", "default", "fp32", 1, "nvme", "trainer"),
    # TRL as the issue ran it: a PEFT policy, gradient_checkpointing=False, bf16=False.
    Cell("llama", "lora", "none", "fp32", 1, "nvme", "sft"),
    # TRL's own defaults: checkpointing on (transformers' default flavour), bf16=True (autocast on the CPU).
    Cell("mixtral", "lora", "default", "autocast", 1, "nvme", "sft"),
    Cell("llama", "lora", "none", "fp32", 1, "nvme", "dpo"),
    Cell("gpt2", "full", "nonreentrant", "fp32", 3, "nvme", "dpo"),
    # GRPO: the PEFT policy samples its completions through the engine (model.generate), one generation
    # per 3 micro-batches (steps_per_generation = gradient accumulation).
    Cell("llama", "lora", "nonreentrant", "fp32", 3, "nvme", "grpo"),
]

# Cells known to fail now, with the error measured when the mark was set (removed as they are fixed).
XFAIL: dict = {}

CELLS = full_matrix() if FULL else FAST


def _params(cells):
    out = []
    for c in cells:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[c.id])] if (c.id in XFAIL and not FULL) else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def _report(cell, result, took):
    path = os.environ.get("TIERMEM_PARITY_REPORT")
    if path:
        row = {"id": cell.id, "seconds": round(took, 2), "fails": check(cell, result),
               **{k: v for k, v in result.items() if k != "trace"}}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _assert(cell, result):
    bad = check(cell, result)
    assert not bad, f"{cell.id}: " + "; ".join(bad) + f"\n{summary(result)}\n{result.get('trace', '')}"


def _need(cell):
    hf_or_skip()
    for mod in (["peft"] if cell.trains == "lora" else []) + (["trl", "datasets"] if cell.entry in ("sft", "dpo", "grpo")
                                                              else []) + (["accelerate"] if cell.in_child() else []):
        pytest.importorskip(mod)


@pytest.mark.parametrize("cell", _params([c for c in CELLS if not c.in_child()]))
def test_own_loop(torch_or_skip, tmp_path, cell):
    _need(cell)
    t0 = time.monotonic()
    result = run_cell(cell, str(tmp_path))
    _report(cell, result, time.monotonic() - t0)
    _assert(cell, result)


@pytest.fixture(scope="module")
def child_results(request, tmp_path_factory):
    """The HF Trainer and TRL cells selected in this session, run in one child process (accelerate wraps
    a model in DDP when torch.distributed is initialised in the process, as other tests leave it)."""
    cells = [item.callspec.params["cell"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_trainer_entry_points" and hasattr(item, "callspec")]
    t0 = time.monotonic()
    results = run_in_child(cells, str(tmp_path_factory.mktemp("parity-child")), timeout=60 * max(10, len(cells)))
    return results, (time.monotonic() - t0) / max(1, len(cells))


@pytest.mark.parametrize("cell", _params([c for c in CELLS if c.in_child()]))
def test_trainer_entry_points(torch_or_skip, cell, child_results):
    _need(cell)
    results, took = child_results
    result = results[cell.id]
    _report(cell, result, took)
    _assert(cell, result)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_lora_nonreentrant(torch_or_skip, tmp_path):
    """PEFT LoRA with non-reentrant checkpointing at 2 ranks (torchrun, gloo), each rank half of every
    micro-batch, against the plain single-process run on the whole micro-batch."""
    hf_or_skip()
    pytest.importorskip("peft")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found beside the interpreter or on PATH")
    out = tmp_path / "dist.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERMEM_COLLECTIVE_TIMEOUT_S="60",
               TIERMEM_PARITY_CELL=json.dumps(DIST_CELL.__dict__))
    here = os.path.dirname(os.path.abspath(__file__))
    t0 = time.monotonic()

    def run(swap):
        return subprocess.run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                               str(_port()), os.path.join(here, "parity.py"), "dist", str(out), str(swap)],
                              capture_output=True, text=True, timeout=600, env=env, cwd=here)

    p = run(tmp_path / "swap")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    result = json.loads(out.read_text())
    _report(DIST_CELL, result, time.monotonic() - t0)
    _assert(DIST_CELL, result)
