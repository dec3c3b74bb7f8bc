"""One run of test_torch_init's memory check, in its own process: builds a Llama shape under
tiermem.torch.zero.Init (or nothing, for the baseline), trains 2 steps with its state on NVMe at
fixed budgets, and prints one JSON line: max RSS from getrusage and the sizes."""

import json
import resource
import sys

import torch
import transformers

import tiermem.torch as tt


def main() -> None:
    layers, swap = int(sys.argv[1]), sys.argv[2]
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    out = {"layers": layers}
    if layers > 0:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "offload_param": {"device": "nvme", "nvme_path": swap},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
               "tiermem": {"host_budget_bytes": "24MiB", "device_budget_bytes": "8MiB", "log_level": "warn"}}
        shape = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         max_position_embeddings=64)
        with tt.zero.Init(config=cfg):
            model = transformers.LlamaForCausalLM(shape)
        engine, *_ = tt.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            b = torch.randint(0, 512, (1, 32), generator=g)
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            engine.step()
        st = engine.stats()
        out.update(params=sum(u.numel for u in engine.units), optimizer_state_bytes=st["optimizer_state_bytes"],
                   nvme_written_bytes=st["nvme_written_bytes"], host_pool_peak_bytes=st["host_pool_peak_bytes"],
                   loss=float(loss))
        engine.close()
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
