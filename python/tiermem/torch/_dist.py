"""The collectives ZeroEngine runs over torch.distributed when a tiermem.torch run has several
ranks (torchrun, mpirun, or any launcher setting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). The C++
engine calls these methods with 1-D CPU tensors viewing its own buffers; each runs synchronously on
the process group (gloo on CPU). No transport is written here: torch.distributed's.

The group is the default one (or, when the default group cannot take CPU tensors, as an NCCL one
cannot, a gloo group made beside it): the caller's, if torch.distributed is already initialised, else one
made here from the environment (init_method env://) with gloo and a collective timeout of
``TIERMEM_COLLECTIVE_TIMEOUT_S`` seconds (default 120): a rank that died makes the others fail
within it, naming the operation, instead of hanging. A group made here is destroyed here, at
interpreter exit (atexit), unless the caller destroyed it first: gloo's worker threads left to the
interpreter's finalisation abort the process ("terminate called without an active exception",
pytorch/pytorch#190489), after a run that succeeded.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist


# The launchers' variables: (world size, this rank), torchrun's first, then Open MPI's and PMI's.
LAUNCH_VARIABLES = (("WORLD_SIZE", "RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"))


def _launch_int(key: str) -> int:
    text = os.environ[key]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"tiermem.torch: {key}={text!r} in the environment is not an integer. A launcher (torchrun, "
                         "mpirun) sets it; start the ranks with one, or unset it to run one process") from None


def launched_world_size() -> int:
    """The world size: torch.distributed's when it is initialised, else the launcher's variables'
    (1 without them). Raises ValueError for a world size below 1, a rank outside 0 .. world size - 1
    or a value that is no integer, naming the variable: a rank given a wrong RANK would otherwise
    wait for peers that never come, or run alone as if it were the whole job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    for size_key, rank_key in LAUNCH_VARIABLES:
        if not os.environ.get(size_key):
            continue
        size = _launch_int(size_key)
        if size < 1:
            raise ValueError(f"tiermem.torch: {size_key}={size} in the environment: a world size is at least 1; "
                             "start the ranks with a launcher (torchrun, mpirun), or unset it to run one process")
        if os.environ.get(rank_key):
            rank = _launch_int(rank_key)
            if not 0 <= rank < size:
                raise ValueError(f"tiermem.torch: {rank_key}={rank} in the environment is no rank of {size_key}={size} "
                                 f"(ranks 0 .. {size - 1}); start the ranks with a launcher (torchrun, mpirun), which "
                                 "sets both, or unset them to run one process")
        return size
    return 1


def ensure_process_group() -> None:
    if dist.is_initialized():
        return
    env = os.environ
    # mpirun sets its own variables: map them to torch's (the address and port must be given).
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(f"tiermem.torch: several ranks but {' and '.join(missing)} not set; start the ranks with "
                           "torchrun, or set MASTER_ADDR and MASTER_PORT for mpirun")
    timeout = float(env.get("TIERMEM_COLLECTIVE_TIMEOUT_S", "120"))
    dist.init_process_group(backend="gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    atexit.register(_destroy_made_group, dist.group.WORLD)


def _destroy_made_group(group) -> None:
    """At exit: destroys the default group ensure_process_group made, if it is still the default
    one (the caller may have destroyed it, and made another, meanwhile). Local: no collective."""
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


def keep_frozen_out_of_ddp(model: torch.nn.Module) -> None:
    """Names `model`'s frozen parameters in ``_ddp_params_and_buffers_to_ignore`` (added to what is
    there), the list torch's DistributedDataParallel skips.

    Under a launcher's environment (``LOCAL_RANK`` set, as torchrun and ``accelerate launch`` set it,
    even for one rank), accelerate makes a gloo group on the CPU and the HF Trainer wraps the model
    in DDP. DDP's constructor broadcasts every parameter it keeps: for an engine model each
    ``param.detach()`` gathers its unit into a copy, and all of them are held at once, so the whole
    base was read from its tier into host memory (twice its bytes at the peak, with the broadcast's
    buckets) even at world size 1. A frozen parameter has no gradient for DDP to reduce and the
    engine keeps it the same on every rank, so DDP has nothing to do with it; the trainable ones
    (a LoRA adapter) stay DDP's (it refuses a model with none)."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        have = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        model._ddp_params_and_buffers_to_ignore = have + [n for n in frozen if n not in have]


class DistOps:
    """``unit`` (set by the hooks around each gather: the engine unit's index, -1 for the engine's
    own all-gathers) and ``unit_names`` let every all-gather first check that all ranks gather the
    same module: a rank whose module order diverged (rank-dependent control flow) is reported with
    the modules' names instead of a hang or a size mismatch deep in the transport."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # The engine's buffers are host memory: a default group that cannot take CPU tensors
        # (NCCL, for a model on CUDA) gets a gloo group beside it for the engine's collectives.
        # new_group is itself collective; every rank constructs DistOps in initialize.
        self.group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
        self.unit = -1
        self.unit_names: list[str] = []
        # The time the stepping thread spent blocked in collectives (a synchronous call, or the
        # wait on an asynchronous one): the communication that compute did not hide. Seconds.
        self.blocked_s = 0.0
        self.calls = 0
        # Each rank's host and pid, so that a failed collective can say which rank is gone.
        self.peers: list = [None] * self.world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()), group=self.group)
        self.native_reduce_scatter = self._probe_reduce_scatter()

    def _probe_reduce_scatter(self) -> bool:
        """Whether this torch's gloo runs reduce_scatter_tensor (torch 2.15's does): one collective of
        world_size elements at start, the same outcome on every rank. Without it a bucket is
        all-reduced whole (a copy of world_size x bucket) and each rank keeps its part;
        TIERMEM_DIST_REDUCE_SCATTER=all_reduce chooses that path anyway (set on every rank)."""
        if os.environ.get("TIERMEM_DIST_REDUCE_SCATTER", "") == "all_reduce":
            return False
        try:
            probe = torch.ones(self.world_size)
            out = torch.empty(1)
            dist.reduce_scatter_tensor(out, probe, group=self.group)
            return float(out) == float(self.world_size)
        except (RuntimeError, NotImplementedError, ValueError, AttributeError):
            return False

    def lost_ranks(self) -> tuple[list[int], int]:
        """Ranks on this host whose process no longer runs (gone, or a zombie not yet reaped by its
        launcher), and how many ranks are on other hosts (which cannot be checked from here)."""
        here = socket.gethostname()
        lost, elsewhere = [], 0
        for r, (host, pid) in enumerate(self.peers):
            if r == self.rank:
                continue
            if host != here:
                elsewhere += 1
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state in ("Z", "X"):
                    lost.append(r)
            except OSError:
                lost.append(r)
        return lost, elsewhere

    def _failed(self, op: str, e: Exception) -> RuntimeError:
        lost, elsewhere = self.lost_ranks()
        if lost:
            who = ", ".join(f"rank {r} (pid {self.peers[r][1]})" for r in lost)
            why = f"{who} is no longer running" if len(lost) == 1 else f"{who} are no longer running"
        else:
            why = "no rank on this host has exited" + (f"; {elsewhere} ranks on other hosts were not checked"
                                                       if elsewhere else "")
        return RuntimeError(f"the engine's {op} failed on rank {self.rank} of {self.world_size}: {why} ({e}). "
                            "Every rank must run the same steps; see the lost rank's own log for why it stopped")

    def _run(self, op: str, fn, *args, issue: bool = True):
        """Runs one collective's blocking part (`issue`: it starts one, counted in comm_calls; else
        the wait for one started before)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:  # gloo's DistBackendError / DistNetworkError, a timeout
            if "the ranks gather different modules" in str(e):
                raise
            raise self._failed(op, e) from e
        finally:
            self.blocked_s += time.perf_counter() - t0
            self.calls += issue

    def stats(self) -> dict:
        """comm_blocked_s: seconds the stepping thread was blocked in the engine's collectives since
        initialize (what compute did not hide); comm_calls: how many it ran."""
        return {"comm_blocked_s": self.blocked_s, "comm_calls": self.calls}

    def _check_same_module(self, count: int) -> None:
        mine = torch.tensor([self.unit, count], dtype=torch.int64)
        every = torch.empty(2 * self.world_size, dtype=torch.int64)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        pairs = every.view(self.world_size, 2).tolist()
        if any(p != pairs[0] for p in pairs):
            def name(u, n):
                return f"'{self.unit_names[u]}'" if 0 <= u < len(self.unit_names) else f"an engine buffer of {n} elements"
            listed = ", ".join(f"rank {r} {name(u, n)}" for r, (u, n) in enumerate(pairs))
            raise RuntimeError(f"the ranks gather different modules ({listed}): the module order must be the same on "
                               "every rank (no rank-dependent control flow around modules)")

    def _all_reduce(self, send: torch.Tensor, recv: torch.Tensor, average: bool) -> None:
        if recv.data_ptr() != send.data_ptr():
            recv.copy_(send)
        dist.all_reduce(recv, group=self.group)
        if average:
            recv.div_(self.world_size)

    def _broadcast(self, buf: torch.Tensor, root: int) -> None:
        dist.broadcast(buf, root, group=self.group)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    # The calls the C++ engine makes (TorchDistCommunicator): each names the lost rank on failure.
    def all_reduce(self, send: torch.Tensor, recv: torch.Tensor, average: bool) -> None:
        self._run("all-reduce", self._all_reduce, send, recv, average)

    # The asynchronous forms (the engine's prefetched all-gathers, its overlapped reduce-scatter
    # buckets): the collective runs on the process group's own threads; the engine waits on the
    # returned object when it needs the result.
    def all_gather_async(self, send: torch.Tensor, recv: torch.Tensor) -> "_Pending":
        def start():
            self._check_same_module(send.numel())
            src = send
            if send.data_ptr() == recv.data_ptr() + self.rank * send.numel() * send.element_size():
                src = send.clone()  # in place (the engine's own slot): gloo needs a separate input
            work = dist.all_gather_into_tensor(recv, src, group=self.group, async_op=True)
            return _Pending(self, "all-gather", work, None, src)
        return self._run("all-gather", start)

    def reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, average: bool) -> "_Pending":
        def start():
            if self.native_reduce_scatter:
                work = dist.reduce_scatter_tensor(recv, send, group=self.group, async_op=True)
                return _Pending(self, "reduce-scatter", work, (lambda: recv.div_(self.world_size)) if average else None,
                                None)
            n = recv.numel()
            full = send.clone()  # the sum lands in place; the engine's send buffer stays as it was
            work = dist.all_reduce(full, group=self.group, async_op=True)

            def finish():
                part = full[self.rank * n:(self.rank + 1) * n]
                if average:
                    part.div_(self.world_size)
                recv.copy_(part)
            return _Pending(self, "reduce-scatter", work, finish, full)
        return self._run("reduce-scatter", start)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        self._run("broadcast", self._broadcast, buf, root)

    def barrier(self) -> None:
        self._run("barrier", self._barrier)


class _Pending:
    """One collective in flight: ``wait()`` blocks until it is done and finishes it (its time counts
    in DistOps.blocked_s); ``is_completed()`` polls. ``keep`` holds the tensors it reads or writes."""

    __slots__ = ("ops", "op", "work", "finish", "keep", "done")

    def __init__(self, ops: DistOps, op: str, work, finish, keep) -> None:
        self.ops, self.op, self.work, self.finish, self.keep, self.done = ops, op, work, finish, keep, False

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        self.done = True

        def run():
            self.work.wait()
            if self.finish is not None:
                self.finish()
        try:
            self.ops._run(self.op, run, issue=False)
        finally:
            self.work = self.finish = self.keep = None
