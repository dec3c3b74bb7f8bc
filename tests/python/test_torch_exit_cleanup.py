"""A script that never calls engine.close() (as DeepSpeed's users write them) leaves no swap files
behind: at interpreter exit tiermem.torch closes every engine still open, so the directories the
engine made under nvme_path (its rank directory with the swap file and lock) are gone, and the
user's own directory stays, empty. Run in a child process, which exits with the engine alive."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import sys, torch
import tiermem.torch as tt
from torch_models import batches, build, ds_config
torch.set_num_threads(1)
cfg = ds_config(sys.argv[1], "nvme", tiermem={"host_budget_bytes": "16MiB", "device_budget_bytes": "16MiB"})
model = build("gpt2", layers=2, hidden=64)
engine, *_ = tt.initialize(model=model, config=cfg)
b = batches(1)[0]
loss = engine(input_ids=b, labels=b).loss
engine.backward(loss)
engine.step()
found = [f for _, _, fs in __import__("os").walk(sys.argv[1]) for f in fs]
print("files while training:", sorted(found), flush=True)
# no engine.close(): the interpreter exits with the engine (and its gathered views) alive
"""


def test_swap_files_are_removed_at_exit_without_close(torch_or_skip, tmp_path):
    user_dir = tmp_path / "swap"
    user_dir.mkdir()  # the user's: stays
    nvme = user_dir / "run"  # the engine's to make and remove
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", CHILD, str(nvme)], capture_output=True, text=True, timeout=300,
                       cwd=HERE, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "tiermem-swap-" in p.stdout, p.stdout  # the run did put a swap file there
    left = [os.path.join(r, f) for r, _, fs in os.walk(user_dir) for f in fs]
    assert left == [], f"left behind at exit: {left}\n{p.stderr[-3000:]}"
    assert user_dir.is_dir()
    assert not nvme.exists(), sorted(os.listdir(nvme))


INTERRUPTED = r"""
import sys, torch
import tiermem.torch as tt
from torch_models import ds_config
torch.set_num_threads(1)
cfg = ds_config(sys.argv[1], "nvme", tiermem={"host_budget_bytes": "16MiB", "device_budget_bytes": "16MiB"})

class Interrupted(torch.nn.Module):  # Ctrl-C while its unit is gathered and in use
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = x * self.w
        raise KeyboardInterrupt

torch.manual_seed(0)
engine, *_ = tt.initialize(model=torch.nn.Sequential(torch.nn.Linear(16, 4), Interrupted()), config=cfg)
found = [f for _, _, fs in __import__("os").walk(sys.argv[1]) for f in fs]
print("files while training:", sorted(found), flush=True)
engine(torch.randn(2, 16))
"""


def test_swap_files_are_removed_after_a_keyboard_interrupt_in_forward(torch_or_skip, tmp_path):
    """torch runs its always-call post-forward hooks for Exceptions only, so a KeyboardInterrupt
    in a module's forward leaves that module's unit gathered: closing at exit releases it, else the
    gathered memory would keep the engine, and its swap files, alive (seen 7 of 12 Ctrl-Cs)."""
    nvme = tmp_path / "swap"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", INTERRUPTED, str(nvme)], capture_output=True, text=True, timeout=300,
                       cwd=HERE, env=env)
    assert p.returncode in (130, -2), p.stdout[-3000:] + p.stderr[-5000:]  # died of the interrupt
    assert "KeyboardInterrupt" in p.stderr, p.stderr[-3000:]
    assert "tiermem-swap-" in p.stdout, p.stdout
    assert not nvme.exists(), sorted(os.path.join(r, f) for r, _, fs in os.walk(nvme) for f in fs)


RAISED_IN_A_CALL = r"""
import sys, torch
import tiermem.torch as tt
from torch_models import ds_config
torch.set_num_threads(1)
cfg = ds_config(sys.argv[1], "nvme", tiermem={"host_budget_bytes": "16MiB", "device_budget_bytes": "16MiB"})

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model, plain = build(), build()
engine, *_ = tt.initialize(model=model, config=cfg)
with torch.no_grad():
    v, pv = model[0].weight.view(-1), plain[0].weight.view(-1)
x = torch.randn(2, 16)
engine.backward(engine(x).sum())
engine.step()
plain(x).sum().backward()
torch.optim.SGD(plain.parameters(), lr=0.1).step()
found = [f for _, _, fs in __import__("os").walk(sys.argv[1]) for f in fs]
print("files while training:", sorted(found), flush=True)
v - pv  # torch refuses pv (a no_grad view whose base changed), raised while the unit is gathered for the call
"""


def test_swap_files_are_removed_after_an_uncaught_error_in_a_call_on_a_parameter(torch_or_skip, tmp_path):
    """An uncaught error raised inside a torch call on a released parameter: the traceback Python
    keeps at exit (sys.last_traceback) holds the call's frames, and in them the unit's gathered
    memory, which kept the engine and its swap file and lock alive past the close at exit (found by
    a helper trying the product as a new user)."""
    nvme = tmp_path / "swap"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", RAISED_IN_A_CALL, str(nvme)], capture_output=True, text=True, timeout=300,
                       cwd=HERE, env=env)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-5000:]
    assert "A view was created in no_grad mode" in p.stderr, p.stderr[-3000:]
    assert "tiermem-swap-" in p.stdout, p.stdout
    assert not nvme.exists(), sorted(os.path.join(r, f) for r, _, fs in os.walk(nvme) for f in fs)
