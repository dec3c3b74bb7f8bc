"""glibc's mmap threshold, only when the user asks for it (``TIERMEM_MMAP_THRESHOLD``): read by
``initialize`` (engine.py) and by ``zero.Init``. Once per process. ``return_freed_memory``: what
``initialize`` freed goes back to the system. ``mapped_empty``: a tensor in a mapping of its own,
which glibc's heap never holds.

A library should not change its host process's allocator behind its back, so by default nothing
here touches glibc. The device tier's blocks, which used to fragment glibc's heap most, are
mappings of their own now (SimDevice, src/gpu/sim_device.cc).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

__all__ = ["fix_malloc_threshold", "return_freed_memory", "mapped_empty"]

_malloc_fixed = False


def fix_malloc_threshold(host_budget_bytes: int = 0) -> None:
    """Sets glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) to ``TIERMEM_MMAP_THRESHOLD``
    bytes, once per process, when that variable is set to a positive integer; unset or ``0``,
    glibc's malloc is left as it is. ``host_budget_bytes`` is accepted for the callers' sake and
    not used. A fixed threshold makes every block above it its own mapping, returned to the system
    when freed (lower max RSS, more page faults); glibc's default raises the threshold to the size
    of each mapped block that is freed (up to 32 MiB), after which such blocks come from the heap.
    The measured difference is in docs/benchmarks.md. Not glibc (musl, macOS): nothing.
    Raises ValueError for a value that is not an integer."""
    global _malloc_fixed
    if _malloc_fixed or not sys.platform.startswith("linux"):
        return
    value = os.environ.get("TIERMEM_MMAP_THRESHOLD")
    if value is None:
        return
    try:
        threshold = int(value)
    except ValueError:
        raise ValueError(f"TIERMEM_MMAP_THRESHOLD={value!r}: expected bytes as an integer (e.g. 131072; 0 or unset "
                         "leaves glibc's malloc as it is)") from None
    _malloc_fixed = True
    if threshold <= 0:
        return
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version"):
            libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def return_freed_memory() -> None:
    """Gives the memory glibc holds free back to the system (``malloc_trim(0)``): called once
    ``initialize`` has let go of the model's own parameter values, or of zero.Init's store held in
    host memory (a config that offloads nothing to NVMe), which glibc otherwise keeps in its heap:
    a second copy of the model's size in the process's RSS. Changes no allocator setting. Not
    glibc: nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mapped_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new 1-D CPU tensor of `numel` elements of `dtype` (zero-filled: fresh anonymous pages) in
    an anonymous mapping of its own, unmapped when the tensor and its views are freed: it is never
    part of glibc's heap, which kept freed mid-size blocks (initialize's 16 MiB unit vectors of a
    1.1 B Llama: +0.8 GiB of RSS, issue 57). For buffers made and freed once per unit; the
    mapping costs a system call and page faults, so not for small hot ones. Thread-safe."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel)
