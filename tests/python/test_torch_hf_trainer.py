"""The HF Trainer drives a tiermem.torch model torch-natively: handed
optimizers=(optimizer, lr_scheduler) from tiermem.torch.initialize, it trains 10 steps with its
own loop (loss.backward(), its clipping, optimizer.step(), scheduler.step(), zero_grad) and the
loss falls."""

from torch_models import VOCAB, build, ds_config, hf_or_skip


def test_hf_trainer_trains_10_steps(torch_or_skip, tmp_path):
    torch = torch_or_skip
    transformers = hf_or_skip()
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
    except Exception as e:
        import pytest
        pytest.skip(f"accelerate cannot be imported: {e}")
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
