"""After initialize the model's own values are gone from the process, not only from the model.

A model built under zero.Init with nothing offloaded to NVMe waits for initialize in an Init store
in host memory; once every unit is in the engine that store is freed, and so are the values of a
model built without Init. glibc kept the freed blocks in its heap: the process then held the model
twice (the engine's copy and the freed one), 1.5x the plain loop's RSS on a 246 M LoRA with both
offloads on cpu (issue 57). initialize gives them back (``_malloc.return_freed_memory``)."""

import json
import os
import subprocess
import sys

import pytest

WORKER = r'''
import json, sys, tempfile, torch, transformers
import tiermem.torch as tt
transformers.logging.set_verbosity_error()
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=8000, max_position_embeddings=64)
ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
      "tiermem": {"log_level": "warn"}}
if sys.argv[2] == "keep":  # the baseline: what glibc keeps, as before
    import tiermem.torch.engine
    tiermem.torch.engine.return_freed_memory = lambda: None
if sys.argv[1] == "init":
    with tt.zero.Init(config=ds):
        model = transformers.LlamaForCausalLM(cfg)
else:
    model = transformers.LlamaForCausalLM(cfg)
base = sum(p.numel() * 4 for p in model.parameters())
built = anon()
engine, *_ = tt.initialize(model=model, config=ds)
print(json.dumps({"base": base, "built": built, "initialized": anon()}))
'''


def _run(how: str, trim: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TIERMEM_MMAP_THRESHOLD"}
    p = subprocess.run([sys.executable, "-c", WORKER, how, trim], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["init", "plain"])
def test_initialize_returns_the_models_freed_values(torch_or_skip, how):
    """RssAnon after initialize, against the same run with the freed values left in glibc's heap:
    at least 0.3 of the model's fp32 bytes lower (the engine's fixed costs, pools and threads, are the
    same in both). What glibc keeps of the freed values varies from run to run (0.50-1.0 of the base
    over 8 runs under zero.Init, at 91f96e7 and after; "return" at 525-556 MiB; a CI run at 8b0a5f7
    kept 0.3999, failing a bound of 0.4 by 3 KB), so the bound is below the least it kept. Without
    the return both runs are the baseline, and the difference is only that spread: this check
    catches a lost return most of the time, not every time."""
    pytest.importorskip("transformers")
    kept, returned = _run(how, "keep"), _run(how, "return")
    saved = kept["initialized"] - returned["initialized"]
    assert saved >= 0.3 * returned["base"], (f"initialize returned {saved / returned['base']:.2f} of the base "
                                             f"({returned['base'] >> 20} MiB): {kept} vs {returned}")
