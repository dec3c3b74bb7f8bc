"""DeepSpeed's own NVMe swap code driving tiermem.aio_handle (DS_ACCELERATOR=cpu, gloo on
127.0.0.1, one rank): SwapBufferManager allocates its pinned buffers with the handle's
new_cpu_locked_tensor, AsyncTensorSwapper packs tensors into them and swaps them out with
async_pwrite + wait() (asserting wait()'s count), swap_in_tensors reads them back with async_pread;
every tensor must come back bit for bit. Skipped, naming the import error, only when deepspeed or
torch cannot be imported (scripts/setup.sh --python installs both)."""

import os
import socket

import pytest

import tiermem


@pytest.fixture(scope="module")
def ds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch  # noqa: F401
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.runtime.swap_tensor import async_swapper, utils
    except Exception as e:
        pytest.skip(f"deepspeed cannot be imported: {e}")
    if not dist.is_initialized():
        with socket.socket() as s:  # a free loopback port for the one-rank gloo group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return deepspeed, async_swapper, utils


def test_async_tensor_swapper_round_trip(ds, tmp_path):
    import torch
    _, async_swapper, utils = ds
    h = tiermem.aio_handle(block_size=1 << 20, queue_depth=32)
    numel_alignment = h.get_alignment() // 4  # as DeepSpeed's optimizer swappers compute it
    manager = utils.SwapBufferManager(num_elems=1 << 20, count=3, dtype=torch.float32, aio_handle=h)
    buffers = manager.allocate_all(num_elems=1 << 20, dtype=torch.float32)
    swapper = async_swapper.AsyncTensorSwapper(aio_handle=h, numel_alignment=numel_alignment, timers=None)
    swapper.add_buffers(buffers)  # asserts h.is_pinned() on each

    g = torch.Generator().manual_seed(11)
    sizes = [1, 1000, 4096, 300_001, 1 << 19, (1 << 20) - 3, 777_777, 12_345]
    tensors = [torch.randn(n, generator=g) for n in sizes]
    paths = [str(tmp_path / f"t{i}.swp") for i in range(len(sizes))]
    swapper.swap_out_tensors(tensors, paths)  # flushes (async_pwrite + wait) as buffers fill
    returned = swapper.release_buffers()       # flushes the rest; asserts wait()'s counts
    assert len(returned) == 3 and not swapper.has_buffers()

    aligned = [swapper._io_aligned_numel(n) for n in sizes]
    back = [h.new_cpu_locked_tensor(a, tensors[0]) for a in aligned]
    utils.swap_in_tensors(h, back, paths)  # asserts async_pread() == 0
    assert h.wait() == len(sizes)
    for t, b, a, p in zip(tensors, back, aligned, paths):
        assert os.path.getsize(p) == 4 * a
        assert torch.equal(b[: t.numel()], t)
    manager.free(buffers)


def test_handle_answers_deepspeeds_questions(ds, tmp_path):
    import torch
    h = tiermem.aio_handle(intra_op_parallelism=2)
    assert h.get_alignment() == 8192
    t = h.new_cpu_locked_tensor(1 << 16, torch.zeros(1, dtype=torch.bfloat16))
    assert h.is_pinned(t) and h.is_pinned(t.narrow(0, 100, 1000))
    assert not h.is_pinned(torch.zeros(10))
    with open(tmp_path / "fd.bin", "wb") as f:  # DeepSpeed's async_pwrite(buffer, fd) overload
        t.copy_(torch.arange(1 << 16).to(torch.bfloat16))
        assert h.async_pwrite(t, f.fileno()) == 0
        assert h.wait() == 1
    back = torch.empty_like(t)
    h.sync_pread(back, str(tmp_path / "fd.bin"))
    assert torch.equal(back, t)
