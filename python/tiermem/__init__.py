"""tiermem from Python: tiermem's io_uring engine, NVMe swap space and SIMD AdamW.

    import tiermem
    h = tiermem.aio_handle()                       # DeepSpeed's aio_handle, on tiermem's engine
    buf = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    h.async_pwrite(buf, "/mnt/nvme0/x.bin"); h.wait()

    from tiermem.torch import CPUAdamW, NVMeAdamW  # torch.optim optimizers (need torch)

Arrays cross into C++ without copies through DLPack or the buffer protocol: numpy arrays and torch
CPU tensors both work, and the extension does not link torch. Every buffer must be C-contiguous
and on the CPU; a destination must be writable. A wrong array raises TypeError (not an array) or
ValueError (dtype, layout, size), naming the function and the argument. An I/O failure raises
tiermem.IoError, an OSError with errno, strerror, filename, offset and length (bytes).
"""

from __future__ import annotations

import os
from typing import Any

from . import _tiermem
from ._tiermem import IoError, Request, SwapSpace, adam_isa, adam_step, new_locked_array

__all__ = [
    "aio_handle",
    "IoError",
    "SwapSpace",
    "Request",
    "adam_step",
    "adam_isa",
    "new_locked_array",
    "locked_array",
]

__version__ = "0.1.0"


def locked_array(nbytes: int):
    """A zero-filled, 4096-aligned uint8 numpy array of `nbytes` bytes, page-locked (mlock) when
    RLIMIT_MEMLOCK allows (best effort; the memory works either way). Freed (unlocked and
    unmapped) when the last reference to it, or to any view of it, goes away. MemoryError for a
    size no mapping can have (2**63 bytes or more) or the OS refuses."""
    if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 1 << 63:
        raise MemoryError(f"locked_array: {nbytes} bytes is beyond any mapping (at most 2**63 - 1)")
    arr, _locked = new_locked_array(nbytes)
    return arr


class aio_handle(_tiermem._AioHandle):
    """DeepSpeed's ``AsyncIOBuilder().load().aio_handle(...)``, over tiermem's IoEngine.

    ``aio_handle(block_size=1 MiB, queue_depth=128, single_submit=False, overlap_events=True,
    intra_op_parallelism=1)``: block_size (bytes, a multiple of 4096) is the piece size requests
    are split into; queue_depth the pieces in flight per ring; intra_op_parallelism the number of
    io_uring rings (each with its completion thread). single_submit submits one piece per
    io_uring_enter. overlap_events is accepted and reported by get_overlap_events() only (the
    engine always overlaps submission and completion).

    Methods, as DeepSpeed's (``buffer`` is a torch tensor or numpy array, C-contiguous, on the CPU;
    ``filename`` a path; ``file_offset`` bytes):

    - ``async_pread(buffer, filename, file_offset=0)`` / ``async_pwrite(...)``: start the transfer
      of buffer.nbytes bytes; return 0. The buffer must stay untouched until ``wait()``.
    - ``sync_pread`` / ``sync_pwrite`` / ``read(buffer, filename, validate=False, file_offset=0)``
      / ``write``: submit, then ``wait()``; return wait()'s count.
    - ``pread(buffer, filename, validate, async, file_offset=0)`` / ``pwrite``: async=True is
      async_*, async=False is sync_*. validate=True re-reads the range with plain pread after the
      transfer and compares; a difference raises tiermem.IoError (errno 0).
    - ``wait()``: blocks until every pending op is complete and returns how many there were (0 at
      once when none); the first failure among them is raised as tiermem.IoError.
    - ``new_cpu_locked_tensor(num_elem, example_tensor)``: a page-locked, 4096-aligned CPU tensor
      of num_elem elements of example_tensor's dtype (a numpy array when example_tensor is one);
      ``free_cpu_locked_tensor(tensor)`` releases the handle's reference.
    - ``is_pinned(tensor)``, ``get_alignment()`` (4096 x intra_op_parallelism), and
      ``async_pwrite(buffer, fd, file_offset)`` with an open file descriptor, as DeepSpeed's.
    - ``get_block_size()``, ``get_queue_depth()``, ``get_single_submit()``,
      ``get_overlap_events()``, ``get_intra_op_parallelism()``; tiermem's own: ``get_engine()``
      ("uring" or "posix"), ``get_pending()``, ``get_buffered_fallbacks()``.

    Differences from DeepSpeed's handle:

    - file_offset must be a multiple of 4096 on O_DIRECT files (ValueError naming file_offset);
      buffers may have any address and length (unaligned parts go through a bounce copy).
    - Filesystems that refuse O_DIRECT (tmpfs) are used buffered instead of failing;
      get_buffered_fallbacks() counts such opens.
    - A write's O_DIRECT zero padding past the end of the data is cut off when wait() reaps it, so
      the file is exactly as long as the data (or as it was, if longer).
    - A read past the end of the file raises ValueError naming 'buffer' before any I/O.
    - Failures raise tiermem.IoError (an OSError) instead of printing and returning -1.

    Thread-safety: several threads may share a handle (submissions are serialised by an internal
    mutex); wait() reaps every op pending when it starts and releases the GIL while it blocks.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
    ) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
        self._locked: dict[int, tuple[int, int, Any]] = {}  # id -> (start, end address, tensor)

    def get_alignment(self) -> int:
        """DeepSpeed's: the byte multiple callers pad swapped tensors to (4096 per ring). tiermem
        itself needs only file offsets aligned to 4096 on O_DIRECT files."""
        return 4096 * self.get_intra_op_parallelism()

    def async_pwrite(self, buffer: Any, filename: Any, file_offset: int = 0) -> int:
        """Starts writing `buffer` to `filename` at `file_offset` (created when missing); returns 0
        at once, wait() completes it. `filename` may also be an open file descriptor (int), as
        DeepSpeed's overload: the file is reopened by the path /proc/self/fd names (the engine
        opens files with O_NOFOLLOW, so it cannot open the /proc symlink itself)."""
        if isinstance(filename, int) and not isinstance(filename, bool):
            filename = os.readlink(f"/proc/self/fd/{filename}")
        return super().async_pwrite(buffer, filename, file_offset)

    def is_pinned(self, tensor: Any) -> bool:
        """True for a page-locked torch tensor (tensor.is_pinned()) or a tensor or view inside
        memory from this handle's new_cpu_locked_tensor (DeepSpeed's swappers assert it)."""
        if hasattr(tensor, "is_pinned") and tensor.is_pinned():
            return True
        ptr, nbytes = _address_of(tensor)
        for base, end, _ in self._locked.values():
            if base <= ptr and ptr + nbytes <= end:
                return True
        return False

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any):
        """A page-locked, 4096-aligned, zero-filled CPU tensor of `num_elem` elements with
        `example_tensor`'s dtype (torch tensor in, torch tensor out; numpy in, numpy out)."""
        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor: argument 'num_elem' must be an int >= 0, got {num_elem!r}")
        itemsize, kind = _dtype_of(example_tensor, "new_cpu_locked_tensor", "example_tensor")
        try:
            raw = locked_array(num_elem * itemsize)
        except MemoryError:
            raise MemoryError(f"new_cpu_locked_tensor: cannot allocate {num_elem} elements ({num_elem * itemsize} "
                              "bytes) of page-locked host memory") from None
        if kind == "torch":
            import torch

            t = torch.from_numpy(raw).view(example_tensor.dtype)
        else:
            t = raw.view(example_tensor.dtype)
        base, nbytes = _address_of(t)
        self._locked[id(t)] = (base, base + nbytes, t)
        return t

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Releases the handle's reference to a tensor from new_cpu_locked_tensor (the memory is
        unmapped once no other reference remains). Returns False for a tensor it did not make."""
        return self._locked.pop(id(tensor), None) is not None


def _dtype_of(example: Any, fn: str, arg: str) -> tuple[int, str]:
    mod = type(example).__module__
    if mod.startswith("torch"):
        return example.element_size(), "torch"
    if hasattr(example, "dtype") and hasattr(example.dtype, "itemsize"):
        return int(example.dtype.itemsize), "numpy"
    raise TypeError(f"{fn}: argument '{arg}' must be a torch tensor or numpy array, got {type(example).__name__}")


def _address_of(t: Any) -> tuple[int, int]:
    """(address, bytes) of a torch tensor or numpy array."""
    if hasattr(t, "data_ptr"):
        return t.data_ptr(), t.numel() * t.element_size()
    return t.ctypes.data, t.nbytes
