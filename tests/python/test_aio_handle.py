"""tiermem.aio_handle: DeepSpeed's async I/O handle over tiermem's IoEngine.

Round trips from 1 B to 64 MiB, offsets, many operations in flight, wait() with nothing queued,
the DeepSpeed call forms (pread/pwrite with validate/async, read/write, sync_*), locked tensors,
and every bad-input and I/O-failure case raising the documented exception."""

import errno
import os
import time

import numpy as np
import pytest

import tiermem

SIZES = [1, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 5, 64 << 20]


def payload(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.fixture
def handle():
    return tiermem.aio_handle()


def test_defaults_and_getters():
    h = tiermem.aio_handle()
    assert h.get_block_size() == 1 << 20
    assert h.get_queue_depth() == 128
    assert h.get_single_submit() is False
    assert h.get_overlap_events() is True
    assert h.get_intra_op_parallelism() == 1
    assert h.get_engine() in ("uring", "posix")
    h2 = tiermem.aio_handle(block_size=256 << 10, queue_depth=8, single_submit=True,
                            overlap_events=False, intra_op_parallelism=2)
    assert (h2.get_block_size(), h2.get_queue_depth(), h2.get_single_submit(),
            h2.get_overlap_events(), h2.get_intra_op_parallelism()) == (256 << 10, 8, True, False, 2)


@pytest.mark.parametrize("n", SIZES)
def test_async_round_trip(handle, tmp_path, n):
    path = str(tmp_path / "f.bin")
    src = payload(n, n)
    assert handle.async_pwrite(src, path) == 0
    assert handle.wait() == 1
    assert os.path.getsize(path) == n  # O_DIRECT padding is cut off
    dst = np.zeros(n, np.uint8)
    assert handle.async_pread(dst, path) == 0
    assert handle.wait() == 1
    np.testing.assert_array_equal(dst, src)


def test_sync_forms_and_offsets(handle, tmp_path):
    path = str(tmp_path / "f.bin")
    a, b = payload(10000, 1), payload(5000, 2)
    assert handle.sync_pwrite(a, path) == 1
    assert handle.sync_pwrite(b, path, 8192) == 1
    assert os.path.getsize(path) == 8192 + 5000
    got = np.zeros(5000, np.uint8)
    assert handle.sync_pread(got, path, file_offset=8192) == 1
    np.testing.assert_array_equal(got, b)
    head = np.zeros(8192, np.uint8)
    assert handle.read(head, path, False) == 1
    np.testing.assert_array_equal(head, a[:8192])
    assert handle.write(a, path, True) == 1  # validate=True compares the file with the buffer
    # pread/pwrite(buffer, filename, validate, async[, file_offset]) as DeepSpeed's.
    assert handle.pwrite(b, path, True, False, 4096) == 1
    assert handle.pread(got, path, True, True, 4096) == 0
    assert handle.wait() == 1
    np.testing.assert_array_equal(got, b)


def test_many_in_flight(tmp_path):
    h = tiermem.aio_handle(block_size=64 << 10, queue_depth=16, intra_op_parallelism=2)
    n, count = 300 << 10, 64
    srcs = [payload(n, i) for i in range(count)]
    for i, s in enumerate(srcs):  # half to separate files, half to offsets of one file
        path = str(tmp_path / (f"f{i}.bin" if i % 2 else "shared.bin"))
        off = 0 if i % 2 else (i // 2) * (512 << 10)
        h.async_pwrite(s, path, off)
    assert h.get_pending() == count
    assert h.wait() == count
    dsts = [np.zeros(n, np.uint8) for _ in range(count)]
    for i, d in enumerate(dsts):
        path = str(tmp_path / (f"f{i}.bin" if i % 2 else "shared.bin"))
        off = 0 if i % 2 else (i // 2) * (512 << 10)
        h.async_pread(d, path, off)
    assert h.wait() == count
    for s, d in zip(srcs, dsts):
        np.testing.assert_array_equal(d, s)


def test_wait_with_nothing_queued_returns_at_once(handle):
    t0 = time.perf_counter()
    assert handle.wait() == 0
    assert handle.wait() == 0
    assert time.perf_counter() - t0 < 0.5


def test_zero_byte_ops_complete(handle, tmp_path):
    path = str(tmp_path / "empty.bin")
    handle.async_pwrite(np.zeros(0, np.uint8), path)
    assert handle.wait() == 1
    assert os.path.getsize(path) == 0
    handle.async_pread(np.zeros(0, np.uint8), path)
    assert handle.wait() == 1


def test_buffer_dropped_before_wait_stays_alive(handle, tmp_path):
    path = str(tmp_path / "f.bin")
    handle.async_pwrite(payload(1 << 20, 7), path)  # the only reference is the handle's
    assert handle.wait() == 1
    got = np.zeros(1 << 20, np.uint8)
    handle.sync_pread(got, path)
    np.testing.assert_array_equal(got, payload(1 << 20, 7))


def test_torch_locked_tensors(handle, tmp_path, torch_or_skip):
    torch = torch_or_skip
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
        t = handle.new_cpu_locked_tensor(12345, torch.empty(0, dtype=dtype))
        assert t.dtype == dtype and t.numel() == 12345 and t.data_ptr() % 4096 == 0
        assert torch.count_nonzero(t).item() == 0
        src = torch.randint(0, 100, (12345,)).to(dtype)
        t.copy_(src)
        path = str(tmp_path / f"t_{dtype}.bin")
        handle.async_pwrite(t, path)
        assert handle.wait() == 1
        back = handle.new_cpu_locked_tensor(12345, t)
        handle.sync_pread(back, path)
        assert torch.equal(back, src)
        assert handle.free_cpu_locked_tensor(t) is True
        assert handle.free_cpu_locked_tensor(back) is True
        assert handle.free_cpu_locked_tensor(src) is False
    # An ordinary (unaligned, pageable) torch tensor works too, through the bounce buffer.
    x = torch.arange(1001, dtype=torch.float32)[1:]
    handle.sync_pwrite(x, str(tmp_path / "x.bin"))
    y = torch.empty(1000)
    handle.sync_pread(y, str(tmp_path / "x.bin"))
    assert torch.equal(x, y)


def test_numpy_locked_array(handle, tmp_path):
    a = handle.new_cpu_locked_tensor(1000, np.zeros(1, np.float32))
    assert a.dtype == np.float32 and a.size == 1000 and a.ctypes.data % 4096 == 0
    with pytest.raises(MemoryError, match=r"new_cpu_locked_tensor: cannot allocate 1125899906842624 elements"):
        handle.new_cpu_locked_tensor(1 << 50, np.zeros(1, np.uint8))
    with pytest.raises(MemoryError, match=r"new_cpu_locked_tensor: cannot allocate 18446744073709551616 elements"):
        handle.new_cpu_locked_tensor(1 << 64, np.zeros(1, np.uint8))


# ---- bad input: each raises ValueError/TypeError naming the argument -------------------------------

def test_unaligned_offset_rejected_on_o_direct(handle, tmp_path):
    path = str(tmp_path / "f.bin")
    handle.sync_pwrite(payload(8192, 1), path)
    with pytest.raises(ValueError, match="file_offset"):
        handle.async_pread(np.zeros(10, np.uint8), path, 3)
    with pytest.raises(ValueError, match="file_offset"):
        handle.async_pwrite(np.zeros(10, np.uint8), path, 4097)
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pread(np.zeros(10, np.uint8), path, -4096)
    assert handle.wait() == 0  # nothing was queued


def test_read_past_end_of_file(handle, tmp_path):
    path = str(tmp_path / "f.bin")
    handle.sync_pwrite(payload(5000, 1), path)
    with pytest.raises(ValueError, match="'buffer' is 8192 bytes"):
        handle.sync_pread(np.zeros(8192, np.uint8), path)
    with pytest.raises(ValueError, match="buffer"):
        handle.sync_pread(np.zeros(1000, np.uint8), path, 4096)


def test_not_an_array(handle, tmp_path):
    with pytest.raises(TypeError, match="'buffer'"):
        handle.async_pwrite([1, 2, 3], str(tmp_path / "f.bin"))
    with pytest.raises(TypeError, match="'buffer'"):
        handle.async_pread(None, str(tmp_path / "f.bin"))
    with pytest.raises(TypeError, match="example_tensor"):
        handle.new_cpu_locked_tensor(10, [1.0])
    with pytest.raises(ValueError, match="num_elem"):
        handle.new_cpu_locked_tensor(-1, np.zeros(1))


def test_non_contiguous_and_read_only(handle, tmp_path, torch_or_skip):
    torch = torch_or_skip
    path = str(tmp_path / "f.bin")
    handle.sync_pwrite(payload(1 << 16, 1), path)
    with pytest.raises(ValueError, match="'buffer' is not contiguous"):
        handle.async_pread(np.zeros((64, 64), np.uint8)[:, ::2], path)
    with pytest.raises(ValueError, match="'buffer' is not contiguous"):
        handle.async_pwrite(torch.zeros(64, 64).t(), path)
    ro = np.zeros(100, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="'buffer' is read-only"):
        handle.async_pread(ro, path)
    handle.sync_pwrite(ro, path)  # a read-only source is fine


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="block_size"):
        tiermem.aio_handle(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        tiermem.aio_handle(queue_depth=0)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        tiermem.aio_handle(intra_op_parallelism=0)


# ---- I/O failures: tiermem.IoError (an OSError) with path, offset, length, errno -----------------

def test_missing_file_is_io_error(handle, tmp_path):
    path = str(tmp_path / "missing.bin")
    with pytest.raises(tiermem.IoError) as info:
        handle.sync_pread(np.zeros(10, np.uint8), path)
    e = info.value
    assert isinstance(e, OSError)
    assert e.errno == errno.ENOENT and e.filename == path
    assert e.offset == 0 and e.length == 0
    with pytest.raises(tiermem.IoError) as info:
        handle.sync_pwrite(np.zeros(10, np.uint8), str(tmp_path / "no_dir" / "f.bin"))
    assert info.value.errno == errno.ENOENT


def test_directory_is_io_error(handle, tmp_path):
    with pytest.raises(OSError) as info:
        handle.sync_pwrite(np.zeros(10, np.uint8), str(tmp_path))
    assert isinstance(info.value, tiermem.IoError) and info.value.errno == errno.EISDIR


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_failed_completion_raises_from_wait(handle):
    # /dev/full accepts the open and fails every write with ENOSPC: the failure arrives through
    # the completion, so async_pwrite succeeds and wait() raises, with the piece's offset/length.
    assert handle.async_pwrite(np.ones(8192, np.uint8), "/dev/full") == 0
    with pytest.raises(tiermem.IoError) as info:
        handle.wait()
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == "/dev/full"
    assert e.offset == 0 and e.length == 8192
    assert handle.wait() == 0  # the failed op was reaped


def test_tmpfs_falls_back_to_buffered(handle):
    import tempfile
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = os.path.join(d, "f.bin")
        src = payload(10001, 3)
        handle.sync_pwrite(src, path)
        got = np.zeros(10001, np.uint8)
        handle.sync_pread(got, path)
        np.testing.assert_array_equal(got, src)
        # Kernels before 6.6 refuse O_DIRECT on tmpfs: then both opens went buffered.
        assert handle.get_buffered_fallbacks() in (0, 2)


def test_dropping_a_handle_with_pending_ops_waits(tmp_path):
    path = str(tmp_path / "f.bin")
    h = tiermem.aio_handle()
    h.async_pwrite(payload(4 << 20, 9), path)
    del h  # the destructor waits for the write (its errors are dropped); nothing aborts
    got = np.zeros(4 << 20, np.uint8)
    assert tiermem.aio_handle().sync_pread(got, path) == 1
    np.testing.assert_array_equal(got, payload(4 << 20, 9))


def test_io_error_is_an_oserror_with_its_fields():
    e = tiermem.IoError(5, "boom", "/x")
    assert isinstance(e, OSError) and e.errno == 5 and e.filename == "/x"
