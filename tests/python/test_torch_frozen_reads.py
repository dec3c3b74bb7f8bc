"""A frozen base is read from NVMe at most once a step when the host budget holds what backward
needs of it (issue 57): the engine's recorded trace keeps the frozen units backward reads again
(a frozen Linear's weight for its input gradient) instead of reading them a second time. The
first steps record and first replay the trace; from the fourth step on, the steady state is
checked, through the engine's own counter of frozen bytes read (``nvme_read_frozen_bytes``)."""

import pytest

from torch_models import ds_config, hf_or_skip


def _lora_llama_on_nvme(torch, tmp_path, host_budget):
    """A 4-layer Llama with PEFT LoRA r 4 on q/v, params and optimizer on NVMe at `host_budget` and
    a 1 MiB device budget: (engine, the frozen base's fp32 bytes (2.5 MiB), a fixed token batch)."""
    transformers = hf_or_skip()
    peft = pytest.importorskip("peft")
    import tiermem.torch as tt
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    base = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    engine, *_ = tt.initialize(model=model, config=ds_config(tmp_path, "nvme", tiermem={
        "host_budget_bytes": host_budget, "device_budget_bytes": "1MiB"}))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return engine, base, ids


@pytest.mark.parametrize("host_budget, at_most", [("8MiB", 1.0), ("2MiB", 1.0)])
def test_frozen_base_read_at_most_once_a_step(torch_or_skip, tmp_path, host_budget, at_most):
    torch = torch_or_skip
    engine, base, ids = _lora_llama_on_nvme(torch, tmp_path, host_budget)
    read = []
    for _ in range(6):
        before = engine.stats()["nvme_read_frozen_bytes"]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        read.append((engine.stats()["nvme_read_frozen_bytes"] - before) / base)
    engine.close()
    assert read[0] > 0  # the base is on NVMe: the first step reads it
    steady = read[3:]
    assert max(steady) <= at_most, f"frozen bytes read per step, in bases: {[round(r, 2) for r in read]}"


def test_frozen_base_on_nvme_is_read_where_it_is_not_copied_to_the_device(torch_or_skip, tmp_path):
    """On a device whose memory is the CPU's (the SimDevice of a CPU run), a frozen weight read from
    NVMe into host memory is gathered there: no host -> device copy of the base (before: every
    frozen byte gathered was copied, about a base a step), and host and device cache it as one."""
    torch = torch_or_skip
    engine, base, ids = _lora_llama_on_nvme(torch, tmp_path, "1MiB")
    copied, read = [], []
    for _ in range(5):
        s0 = engine.stats()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        s1 = engine.stats()
        copied.append((s1["host_to_device_bytes"] - s0["host_to_device_bytes"]) / base)
        read.append((s1["nvme_read_frozen_bytes"] - s0["nvme_read_frozen_bytes"]) / base)
    engine.close()
    assert min(read[2:]) > 0.2, f"the budgets hold less than the base: it is read every step ({read})"
    assert max(copied[2:]) < 0.05, f"host -> device bytes a step, in bases: {[round(c, 3) for c in copied]}"
