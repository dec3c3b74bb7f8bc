"""Every command README.md and docs/*.md show as something to run, run as printed, exit status
checked: the lines of their ```sh blocks, and inline `build/default/bin/...` and `mpirun ...`
commands. From the repository root, with environment knobs that shorten long runs without changing
the command line: TIERMEM_STOP_AT=2 (tiermem-train stops after step 2), TIERMEM_EXAMPLE_STEPS=2
(examples/torch/train_hf.py), and OpenMPI's run-as-root and oversubscribe variables (CI runs as
root on 2 cores). A block preceded by `<!-- doc-test: skip: REASON -->` is skipped with its reason;
so is `make test` (this suite is part of it). Files the commands leave in the repository root are
removed afterwards. Needs the C++ build (make test builds it first); skipped without it."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
INLINE = re.compile(r"`((?:build/default/bin/[a-z][a-z-]*|mpirun )[^`]*)`")
SKIP = re.compile(r"<!--\s*doc-test:\s*skip:\s*(.*?)\s*-->")
NEVER = {"make test": "this suite is part of make test"}


def _commands():
    """(where, [commands], skip reason): one entry per ```sh block (its lines run in order, as a
    reader would paste them) and per inline command."""
    out = []
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
        block = None        # the commands of the open ```sh block
        other = False       # inside a fence of another language
        pending_skip = None
        for i, line in enumerate(lines, 1):
            m = SKIP.search(line)
            if m:
                pending_skip = m.group(1)
                continue
            fence = line.strip()
            if fence.startswith("```"):
                if block is not None:
                    out.append((where, block, skip))
                    block = None
                elif other:
                    other = False
                elif fence in ("```sh", "```bash"):
                    block, where, skip = [], f"{doc}:{i + 1}", pending_skip
                else:
                    other = True
                pending_skip = None
                continue
            if block is not None:
                cmd = line.split("  #")[0].strip()
                if cmd and not cmd.startswith("#"):
                    block.append(cmd)
            elif not other:
                if line.strip():
                    pending_skip = None
                for m in INLINE.finditer(line):
                    out.append((f"{doc}:{i}", [m.group(1)], None))
    return out


COMMANDS = _commands()


def test_the_docs_show_commands():
    flat = [c for _, cmds, _ in COMMANDS for c in cmds]
    assert "make demo" in flat and any(c.startswith("mpirun ") for c in flat), flat


@pytest.mark.parametrize("where,cmds,skip", COMMANDS, ids=[f"{w} {c[0][:40]}" for w, c, _ in COMMANDS])
def test_documented_commands_run_as_printed(where, cmds, skip):
    if skip:
        pytest.skip(f"{where}: {skip}")
    if not os.path.exists(os.path.join(ROOT, "build", "default", "bin", "tiermem-train")):
        pytest.skip("no C++ build in build/default (make test builds it before these tests)")
    env = dict(os.environ, TIERMEM_STOP_AT="2", TIERMEM_EXAMPLE_STEPS="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    before = set(os.listdir(ROOT))
    try:
        for cmd in cmds:
            if cmd in NEVER:
                print(f"{where}: `{cmd}` not run: {NEVER[cmd]}")
                continue
            p = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, f"{where}: `{cmd}` exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    finally:
        for name in set(os.listdir(ROOT)) - before:  # me.json, run.jsonl, tiermem-swap, ...
            path = os.path.join(ROOT, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
