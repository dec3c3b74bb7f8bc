"""The HF Trainer drives a tiermem.torch model torch-natively: handed
optimizers=(optimizer, lr_scheduler) from tiermem.torch.initialize, it trains 10 steps with its
own loop (loss.backward(), its clipping, optimizer.step(), scheduler.step(), zero_grad) and the
loss falls. In its own process: accelerate wraps the model in DistributedDataParallel when
torch.distributed is already initialised in the process (other tests here initialise it), and a
tiermem model is not for DDP (the engine reduces the gradients)."""

import os
import subprocess
import sys

import pytest

from torch_models import VOCAB, build, ds_config, hf_or_skip


def test_hf_trainer_trains_10_steps(torch_or_skip, tmp_path):
    hf_or_skip()
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
    except Exception as e:
        pytest.skip(f"accelerate cannot be imported: {e}")
    # Not a launched rank: other tests of this process set the launcher's variables.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)), env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "losses:" in p.stdout


def _train(tmp_path):
    import pathlib

    import torch
    import transformers
    tmp_path = pathlib.Path(tmp_path)
    transformers.logging.set_verbosity_error()
    import tiermem.torch as tt
    model = build("gpt2")
    cfg = ds_config(tmp_path / "swap", "nvme", tiermem={"host_budget_bytes": "1MiB", "device_budget_bytes": "256KiB"})
    cfg["optimizer"]["params"]["lr"] = 3e-3
    (tmp_path / "swap").mkdir()
    engine, optimizer, _, _ = tt.initialize(model=model, config=cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    g = torch.Generator().manual_seed(5)
    # A learnable corpus: the same 4 sequences over and over.
    seqs = [torch.randint(0, VOCAB, (16,), generator=g) for _ in range(4)]
    data = [{"input_ids": seqs[i % 4], "labels": seqs[i % 4]} for i in range(40)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=2,
                                          learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[],
                                          use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10
    assert engine.global_steps == 10
    assert losses[-1] < losses[0] - 0.3, losses
    engine.close()
    print("losses:", losses)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _train(sys.argv[1])
