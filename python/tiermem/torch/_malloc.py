"""glibc's malloc for a run short of host memory (``fix_malloc_threshold``), chosen from the
engine's host budget: by ``initialize`` (engine.py) and by ``zero.Init`` (whose build frees blocks
too). Once per process.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["fix_malloc_threshold"]

_MMAP_THRESHOLD_BYTES = 128 << 10
_SMALL_HOST_BUDGET = 512 << 20
_malloc_fixed = False


def fix_malloc_threshold(host_budget_bytes: int = 0) -> None:
    """Fixes glibc's mmap threshold at 128 KiB (its starting value) for a run short of host memory:
    once per process, when the engine's host budget is at most 512 MiB (TIERMEM_MMAP_THRESHOLD,
    bytes, overrides the choice either way; 0 leaves glibc's malloc as it is).

    glibc raises the threshold to the size of each mmapped block that is freed (up to 32 MiB), so
    after the first step torch's activations and gradients (0.1-30 MB each) come from the heap,
    whose freed pages mostly stay in the process. Fixed, each such block is its own mapping,
    returned to the system when torch frees it, and faulted in page by page when the next is
    made. Measured on GPT-2 124 M with NVMe offload (docs/benchmarks.md): at 256 MiB budgets max
    RSS 1.76 GiB fixed against 2.29 GiB not, at 1 GiB budgets 2.70 against 3.06 GiB; the step is
    14-19 % slower fixed (4.34 against 3.81 s, 2.55 against 2.15 s). So the fixed threshold is what
    a small budget asks for, and the default budgets keep glibc's. Not glibc (musl, macOS): nothing."""
    global _malloc_fixed
    if _malloc_fixed or not sys.platform.startswith("linux"):
        return
    value = os.environ.get("TIERMEM_MMAP_THRESHOLD")
    if value is None:
        if not 0 < host_budget_bytes <= _SMALL_HOST_BUDGET:
            return  # glibc's own behaviour; a later engine with a small budget may still fix it
        threshold = _MMAP_THRESHOLD_BYTES
    else:
        try:
            threshold = int(value)
        except ValueError:
            raise ValueError(f"TIERMEM_MMAP_THRESHOLD={value!r}: expected bytes as an integer (0 leaves glibc's "
                             f"malloc as it is; unset: {_MMAP_THRESHOLD_BYTES} when the host budget is at most "
                             f"{_SMALL_HOST_BUDGET >> 20} MiB)") from None
    _malloc_fixed = True
    if threshold <= 0:
        return
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version"):
            libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
