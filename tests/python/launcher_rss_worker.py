"""One run of test_torch_launcher's memory check, in its own process (the launcher's variables, if
any, are the ones the test gives it): a small Llama built under tiermem.torch.zero.Init, a PEFT
LoRA on q/v, initialize with params and optimizer on NVMe at budgets below the base's bytes, then
2 steps of the HF Trainer. Under RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* (world size 1) accelerate
makes a gloo group and the Trainer wraps the model in DistributedDataParallel; without them it
does not. Prints one JSON line: RssAnon and VmHWM after initialize and after training (bytes),
what the Trainer trained (the wrapper's class), the engine's NVMe reads and the losses."""

import json
import os
import sys

import torch
import transformers

import tiermem.torch as tt


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            k = ln.split(":")[0]
            if k in ("RssAnon", "VmHWM"):
                out[k] = int(ln.split()[1]) * 1024
    return out


def main() -> None:
    import peft
    swap = sys.argv[1]
    transformers.logging.set_verbosity_error()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": swap},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
           "tiermem": {"host_budget_bytes": "8MiB", "device_budget_bytes": "8MiB", "log_level": "warn"}}
    # About 14 M parameters (57 MB in fp32) in units of 4 MiB at most: the budgets (what the host
    # and device tiers may hold, touched or not) are small beside the base.
    shape = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=256, intermediate_size=1024,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    with tt.zero.Init(config=cfg):
        model = transformers.LlamaForCausalLM(shape)
    torch.manual_seed(2)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    engine, optimizer, _, _ = tt.initialize(model=model, config=cfg)
    out = {"frozen_bytes": 4 * sum(p.numel() for p in model.parameters() if not p.requires_grad),
           "initialized": status()}
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 4096, (32,), generator=g) for _ in range(2)]
    data = [{"input_ids": s, "labels": s} for s in seqs]
    args = transformers.TrainingArguments(output_dir=os.path.join(swap, "out"), max_steps=2,
                                          per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
                                          save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    class FirstStep(transformers.TrainerCallback):
        """The NVMe bytes read when the first step begins: the model wrapped (DistributedDataParallel
        under the launcher), nothing trained yet."""

        def on_step_begin(self, args, state, control, **kwargs):
            out.setdefault("read_before_step_1", int(engine.stats()["nvme_read_bytes"]))

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler),
                                   callbacks=[FirstStep()])
    trainer.train()
    out["trained"] = status()
    out["wrapped"] = type(trainer.model_wrapped).__name__
    out["nvme_read_bytes"] = int(engine.stats()["nvme_read_bytes"])
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
