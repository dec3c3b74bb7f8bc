"""docs/python.md's TRL recipes ("TRL: SFT, DPO and GRPO") run as printed: the section's python
blocks (the config helper, then SFT, DPO and GRPO) are executed word for word, each recipe in a fresh
namespace and working directory, with what the docs say is the user's bound to tiny stand-ins: `model`
and `ref_model` a Llama built from a config (hidden 32, 2 layers, vocab 128; parity.build), `tokenizer`
parity's offline word-level tokenizer, `dataset` a few rows in the trainer's format. Then each is
checked: the trainer ran its steps and the engine stepped as often, the adapter moved away from its
zero init, and per recipe: SFT's saved adapter loads with PeftModel.from_pretrained on a plain model
and equals the engine's fp32 master weights; DPO's first loss is ln 2 (the policy starts where the
forward-only reference is) and the reference's weights are unchanged; GRPO logged rewards for
completions the policy generated. Exactness against plain PyTorch is test_torch_parity.py's (the sft,
dpo and grpo cells).

The recipes run in one child process without a launcher's variables: accelerate wraps the model in
DDP when torch.distributed is initialised in the process, as other tests here leave it."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "..", "..", "docs", "python.md")
SECTION = "#### TRL: SFT, DPO and GRPO"
RECIPES = ("sft", "dpo", "grpo")
STEPS = 4  # max_steps in the docs' blocks


def doc_blocks() -> list:
    """The ```python blocks of the section, in order."""
    text = open(DOC, encoding="utf-8").read()
    start = text.index(SECTION)
    end = text.find("\n#", start + len(SECTION))
    body = text[start:end if end >= 0 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def _blocks_by_name() -> dict:
    blocks = doc_blocks()
    assert len(blocks) == 4, f"the section has {len(blocks)} python blocks, want the config and 3 recipes"
    config, *recipes = blocks
    named = {}
    for b in recipes:
        kind = [k for k, cls in (("sft", "SFTTrainer"), ("dpo", "DPOTrainer"), ("grpo", "GRPOTrainer")) if cls in b]
        assert len(kind) == 1, b
        named[kind[0]] = b
    assert sorted(named) == sorted(RECIPES)
    return {"config": config, **named}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torch")
    from torch_models import hf_or_skip
    hf_or_skip()
    for mod in ("peft", "trl", "datasets", "accelerate"):
        pytest.importorskip(mod)
    tmp = tmp_path_factory.mktemp("trl-recipes")
    out = tmp / "results.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp), str(out)], capture_output=True,
                       text=True, timeout=900, cwd=HERE, env=env)
    assert out.exists(), f"the child exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_as_documented(results, recipe):
    r = results[recipe]
    assert "error" not in r, r.get("error", "") + "\n" + r.get("trace", "")
    assert r["global_step"] == STEPS and r["engine_steps"] == STEPS, r
    assert len(r["losses"]) == STEPS and all(math.isfinite(v) for v in r["losses"]), r["losses"]
    assert r["lora_B_max"] > 0, "the adapter never moved from its zero init"
    if recipe == "sft":
        assert r["saved_vs_master"] <= 1e-6, r
    elif recipe == "dpo":
        assert abs(r["losses"][0] - math.log(2)) < 1e-5, r["losses"]  # policy == reference at the start
        assert r["ref_optimizer"] is None and r["ref_unchanged"], r
    else:
        assert r["reward_logged"] and r["completion_length"] > 0, r


# ---------------------------------------------------------------------------------------------------
# the child


def _dataset(kind: str, n: int = 16):
    import datasets
    import torch
    from torch_models import VOCAB
    g = torch.Generator().manual_seed(7)

    def words(k):
        return " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (k,), generator=g))

    if kind == "sft":
        rows = [{"text": words(12)} for _ in range(n)]
    elif kind == "dpo":
        rows = [{"prompt": words(6), "chosen": words(5), "rejected": words(5)} for _ in range(n)]
    else:
        rows = [{"prompt": words(6)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def _run(kind: str, blocks: dict, tmp: str) -> dict:
    import torch
    from parity import build, tokenizer
    from tiermem.torch import utils
    work = os.path.join(tmp, kind)
    os.makedirs(work)
    os.chdir(work)
    ns = {"model": build("llama"), "tokenizer": tokenizer(), "dataset": _dataset(kind)}
    if kind == "dpo":
        ns["ref_model"] = build("llama")
        ref_before = {k: v.clone() for k, v in ns["ref_model"].state_dict().items()}
    exec(compile(blocks["config"], "docs/python.md (config)", "exec"), ns)
    exec(compile(blocks[kind], f"docs/python.md ({kind})", "exec"), ns)
    trainer, engine, policy = ns["trainer"], ns["engine"], ns["policy"]
    hist = trainer.state.log_history
    r = {"global_step": trainer.state.global_step, "engine_steps": engine.global_steps,
         "losses": [h["loss"] for h in hist if "loss" in h]}
    masters = {n: utils.safe_get_full_fp32_param(p) for n, p in policy.named_parameters() if p.requires_grad}
    r["lora_B_max"] = max(t.abs().max().item() for n, t in masters.items() if "lora_B" in n)
    if kind == "sft":
        import peft
        loaded = peft.PeftModel.from_pretrained(build("llama"), os.path.join(work, "sft", "final"))
        got = dict(loaded.named_parameters())
        r["saved_vs_master"] = max((got[n] - t).abs().max().item() for n, t in masters.items())
    elif kind == "dpo":
        ref_engine = ns["ref_engine"]
        r["ref_optimizer"] = None if ref_engine.optimizer is None else type(ref_engine.optimizer).__name__
        after = ns["ref_model"].state_dict()
        r["ref_unchanged"] = all(torch.equal(after[k], v) for k, v in ref_before.items())
        ref_engine.close()
    else:
        r["reward_logged"] = any("reward" in h for h in hist)
        r["completion_length"] = max(h.get("completions/mean_length", 0) for h in hist)
    engine.close()
    return r


def _child_main(tmp: str, path_out: str) -> None:
    import traceback
    import warnings
    warnings.simplefilter("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    blocks = _blocks_by_name()
    out = {}
    for kind in RECIPES:
        try:
            out[kind] = _run(kind, blocks, tmp)
        except Exception as e:
            out[kind] = {"error": f"{type(e).__name__}: {str(e)[:1000]}", "trace": traceback.format_exc()[-4000:]}
        print(kind, json.dumps(out[kind])[:400], flush=True)
    with open(path_out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    _child_main(sys.argv[1], sys.argv[2])
