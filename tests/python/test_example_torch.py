"""examples/torch/train_hf.py runs as the README prints it (shortened to 2 steps by the sample's
TIERMEM_EXAMPLE_STEPS knob) and refuses a missing --config with a message naming the file."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from torch_models import hf_or_skip

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(REPO, "examples", "torch", "train_hf.py")
VENV_PYTHON = "~/.cache/tiermem/venv/bin/python"


def _readme_command() -> list:
    """The README's command line that runs the sample, as argv: the venv's interpreter becomes this
    one, and paths under the repo become absolute (the run's working directory is a temp dir, where
    the config's ./tiermem-swap goes)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = [ln.strip() for ln in f if ln.strip().startswith(f"{VENV_PYTHON} examples/torch/train_hf.py")]
    assert len(lines) == 1, f"README.md should print one command running the sample, found {lines}"
    argv = shlex.split(lines[0].split("#")[0])
    argv[0] = sys.executable
    return [os.path.join(REPO, a) if os.path.exists(os.path.join(REPO, a)) else a for a in argv]


def _run(argv, cwd, steps="2", timeout=240):
    env = dict(os.environ, TIERMEM_EXAMPLE_STEPS=steps, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_command_trains(torch_or_skip, tmp_path):
    hf_or_skip()
    argv = _readme_command()
    assert SAMPLE in argv
    r = _run(argv, tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    steps = re.findall(r"^step (\d+)/2  loss (\d+\.\d+)", r.stdout, re.M)
    assert [s for s, _ in steps] == ["1", "2"], r.stdout
    assert all(0 < float(v) < 10 for _, v in steps), r.stdout
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith("summary: 2 steps")]
    assert summary and "params nvme, optimizer nvme" in summary[0] and "max RSS" in summary[0], r.stdout
    # The config's nvme_path ./tiermem-swap was made for the run (params and optimizer on NVMe, as the
    # summary says) and went with it: a closed engine leaves behind only what the user made.
    assert not os.path.exists(tmp_path / "tiermem-swap"), os.listdir(tmp_path / "tiermem-swap")


def test_missing_config_is_named(tmp_path):
    missing = tmp_path / "no-such-ds_config.json"
    r = _run([sys.executable, SAMPLE, "--config", str(missing)], tmp_path)
    assert r.returncode != 0
    assert f"cannot read --config {missing}: No such file or directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "tiermem-swap")


@pytest.mark.parametrize("flag,message", [(["--heads", "3"], "--hidden 128 is not a multiple of --heads 3"),
                                          (["--data", "/nonexistent/fortunes"], "apt-get install fortunes")])
def test_bad_flags_are_named(tmp_path, flag, message):
    r = _run([sys.executable, SAMPLE, *flag], tmp_path)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
