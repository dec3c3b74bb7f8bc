"""The HF Trainer's own checkpoints resume a tiermem.torch run bit for bit, and its save_model writes
weights a plain model loads.

The Trainer is handed tiermem's optimizer and scheduler (``optimizers=(optimizer, scheduler)``,
the scheduler the config's WarmupLR) with parameters and optimizer state on NVMe at budgets that
page every step. One process trains 8 steps with ``save_steps=4``; a NEW process builds a new
model and engine and runs ``trainer.train(resume_from_checkpoint=<checkpoint-4>)``. The Trainer
restores the optimizer through ``ZeroOptimizer.load_state_dict`` (master weights, moments, step
count), the scheduler and the RNG; the losses of steps 5-8 and every final fp32 master weight must
equal the uninterrupted run's exactly. Then ``trainer.save_model(dir)``: a plain
``from_pretrained`` (PEFT's ``PeftModel.from_pretrained`` on a plain base for an adapter) loads
values equal to the engine's master weights.

Two cases: a GPT-2 trained whole (one micro-batch a step), and a Llama with PEFT LoRA adapters and
gradient accumulation 2. Each run is its own process (accelerate wraps the model in DDP when
torch.distributed is initialised in-process, as other tests here do; and a resume is a new
process)."""

import json
import os
import subprocess
import sys

import pytest

from torch_models import VOCAB, build, ds_config, hf_or_skip

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


_CASES = ("gpt2", "llama-lora-ga2")


def _run(*args) -> dict:
    """Runs this file with `args` in a new process; returns what it printed as JSON on its last line."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *map(str, args)], capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)), env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both cases uninterrupted in one process, then both resumed from checkpoint-4 in another (one
    process a mode: importing transformers is most of a run's time)."""
    pytest.importorskip("torch")
    hf_or_skip()
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
        import peft  # noqa: F401
    except Exception as e:
        pytest.skip(f"accelerate or peft cannot be imported: {e}")
    root = tmp_path_factory.mktemp("hf_resume")
    full = _run("full", root / "full")
    resumed = _run("resume", root / "resumed", root / "full")
    return root, full, resumed


@pytest.mark.parametrize("case", _CASES)
def test_hf_trainer_resume_is_bit_for_bit(runs, case):
    import torch
    root, full, resumed = runs
    full, resumed = full[case], resumed[case]
    assert len(full["losses"]) == 8 * full["gas"], full
    # The micro-batches after the checkpoint: exactly the uninterrupted run's losses.
    after = full["losses"][4 * full["gas"]:]
    assert resumed["losses"] == after, (resumed["losses"], after)
    a = torch.load(root / "full" / case / "master.pt", weights_only=True)
    b = torch.load(root / "resumed" / case / "master.pt", weights_only=True)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # What the Trainer saved is the engine's state (master, moments, step), not hyper-parameters only.
    sd = torch.load(root / "full" / case / "out" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert sd["tiermem"]["steps"] == 4
    assert all(float(s["step"]) == 4 for s in sd["state"].values())
    assert all(s["exp_avg"].abs().sum() > 0 and s["master"].shape == s["exp_avg_sq"].shape
               for s in sd["state"].values())


@pytest.mark.parametrize("case", _CASES)
def test_hf_trainer_save_model_loads_in_plain_model(runs, case):
    # Checked in the run's process (_check_saved): a plain from_pretrained (PEFT's for the
    # adapter) loads values equal to every trainable parameter's fp32 master weights.
    assert runs[1][case]["saved_params_equal"] > 0


def _master_of(model) -> dict:
    from tiermem.torch.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}


def _model(case: str):
    model = build("gpt2" if case == "gpt2" else "llama")
    if case.startswith("llama-lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.1))
    return model


def _train(mode: str, out, case: str, checkpoint) -> dict:
    import torch
    import transformers
    import tiermem.torch as tt
    (out / "swap").mkdir(parents=True)
    gas = 2 if case.endswith("ga2") else 1
    model = _model(case)
    cfg = ds_config(out / "swap", "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    cfg["optimizer"]["params"]["lr"] = 3e-3
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 6}}
    engine, optimizer, _, scheduler = tt.initialize(model=model, config=cfg)
    losses = []
    model.register_forward_hook(lambda m, a, o: losses.append(o.loss.item()) if m.training else None)
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": s, "labels": s} for s in (torch.randint(0, VOCAB, (16,), generator=g) for _ in range(40))]
    args = transformers.TrainingArguments(
        output_dir=str(out / "out"), max_steps=8, per_device_train_batch_size=2, gradient_accumulation_steps=gas,
        learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=4, report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    master = _master_of(model)
    torch.save(master, out / "master.pt")
    res = {"losses": losses, "gas": gas}
    if mode == "full":
        saved = out / "saved"
        trainer.save_model(str(saved))
        res["saved_params_equal"] = _check_saved(case, saved, master)
    engine.close()
    return res


def _check_saved(case: str, saved, master: dict) -> None:
    """save_model's files, loaded by a plain (non-tiermem) model, hold the engine's master weights."""
    import torch
    import transformers
    if case.startswith("llama-lora"):
        import peft
        plain = peft.PeftModel.from_pretrained(build("llama"), str(saved))
    else:
        plain = transformers.GPT2LMHeadModel.from_pretrained(str(saved))
    got = dict(plain.named_parameters())
    assert master, "nothing trains"
    for n, v in master.items():
        assert n in got, (n, sorted(got)[:8])
        assert torch.equal(got[n].detach(), v), n
    return len(master)


if __name__ == "__main__":  # python test_torch_hf_resume.py full|resume OUT [FULL_OUT]
    import pathlib
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    hf_or_skip()
    mode, out = sys.argv[1], pathlib.Path(sys.argv[2])
    ckpt = {c: pathlib.Path(sys.argv[3]) / c / "out" / "checkpoint-4" if mode == "resume" else None for c in _CASES}
    print(json.dumps({c: _train(mode, out / c, c, ckpt[c]) for c in _CASES}))
