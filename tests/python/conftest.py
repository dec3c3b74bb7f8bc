"""pytest set-up for tiermem's Python tests (make test-python).

Every test is deterministic (fixed seeds) and works in its own temporary directory. Tests that need
torch import it through `torch_or_skip`, which skips them with the import error as the reason only
when torch cannot be imported (CI installs it: scripts/setup.sh --python)."""

import os

# tiermem's OpenMP runtime and torch's bundled one alternate in these tests; spinning idle threads
# of one would starve the other on small machines (make test-python sets the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture
def torch_or_skip():
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install's OSError
        pytest.skip(f"torch cannot be imported: {e}")
    torch.manual_seed(0)
    return torch
