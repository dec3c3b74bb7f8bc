"""Where parameters built under ``zero.Init`` wait for ``initialize``, and how they are reached
meanwhile.

Each parameter goes, as soon as its module's ``__init__`` returns, to a staging file under the
config's NVMe path (host memory when the config offloads nothing to NVMe), its ``.data`` a
placeholder of the right shape and its class a subclass of its own (``stage_param``).
Initialisation code that runs later on the whole model (HF's ``post_init``, ``tie_weights``)
reaches each parameter through that class's ``__torch_function__``: loaded, changed in place,
written back. ``initialize`` then registers each engine unit from the staging (``take_staged``),
one unit at a time, and once every unit is in the engine ``release_staging`` drops the staging
(the file goes with its last parameter). A failed ``initialize`` leaves the staging as it was.
A model that never reaches ``initialize`` takes its staging with it: the file, and the directories
tiermem made for it once they hold nothing else, go when the model is garbage-collected or at
interpreter exit.

Thread-safety: single-threaded, as module construction is.
"""

from __future__ import annotations

import errno
import os
import tempfile
import weakref
from typing import Optional

import torch

from ._params import is_metadata, param_subclass, placeholder

__all__ = ["Stage", "stage_param", "take_staged", "drop_staged", "release_staging", "guard_staged_module", "make_marked_dirs",
           "remove_if_unused", "MADE_MARKER"]


# The marker of a directory tiermem made (src/nvme/made_dirs.h): the engine that last uses it
# removes it once nothing else is in it, so a closed engine leaves only what the user made.
MADE_MARKER = ".tiermem-made"


def make_marked_dirs(directory: str) -> list:
    """Makes `directory` and its missing parents (0700), each with the marker, as the engine's
    swap set-up does; a directory that exists is left as it is. Returns the directories to hand to
    remove_if_unused when done, innermost first: `directory` and the parents above it, as far as
    each carries the marker (whoever made it: tiermem's, never the user's)."""
    missing = []
    d = os.path.abspath(directory)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        open(os.path.join(d, MADE_MARKER), "w").close()
    marked = []
    d = os.path.abspath(directory)
    while os.path.isfile(os.path.join(d, MADE_MARKER)):
        marked.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return marked


def remove_if_unused(directory: str) -> None:
    """Removes `directory` when it holds nothing but the marker (the marker goes too), as the
    engine's ``remove_if_unused`` does; one that holds anything else, or is gone, stays. Never
    raises (what cannot be removed stays)."""
    try:
        entries = os.listdir(directory)
        if any(e != MADE_MARKER for e in entries):
            return  # in use: an engine's swap files, another staging, the user's files
        marked = MADE_MARKER in entries
        if marked:
            os.unlink(os.path.join(directory, MADE_MARKER))
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            pass
        except OSError:  # something was put there after the check: it stays, and stays tiermem's
            if marked:
                open(os.path.join(directory, MADE_MARKER), "w").close()
    except OSError:
        pass


class Stage:
    """Where parameters built under Init wait for initialize(): a file under the config's NVMe path
    (offload_param or offload_optimizer nvme), else host memory (the model then lives in host
    memory anyway). Values keep their dtype. Single-threaded, as module construction is."""

    def __init__(self, directory: Optional[str]) -> None:
        self.slots: dict[int, tuple[int, int, torch.dtype, torch.Size]] = {}  # id(p) -> (offset, bytes, dtype, shape)
        self.mem: dict[int, torch.Tensor] = {}
        self.fd = -1
        self.path = None
        self.end = 0
        if directory:
            dirs = make_marked_dirs(directory)
            try:
                fd, self.path = tempfile.mkstemp(prefix="tiermem-init-", suffix=".bin", dir=directory)
            except BaseException:
                for d in dirs:
                    remove_if_unused(d)
                raise
            self.fd = fd
            # The file, then the directories tiermem made for it once nothing else is in them: when
            # initialize has taken the last parameter (drop_staged), when the staged model is
            # garbage-collected, or at interpreter exit (weakref.finalize's atexit).
            self._finalizer = weakref.finalize(self, Stage._remove, fd, self.path, dirs)

    @staticmethod
    def _remove(fd: int, path: str, dirs: list) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
        try:
            os.unlink(path)
        except OSError:
            pass
        for d in dirs:
            remove_if_unused(d)

    def store(self, p: torch.Tensor, values: torch.Tensor) -> None:
        values = values.detach().contiguous()
        if self.fd < 0:
            self.mem[id(p)] = values.clone() if values.data_ptr() == p.data_ptr() else values
            self.slots[id(p)] = (0, 0, values.dtype, values.shape)
            return
        nbytes = values.numel() * values.element_size()
        slot = self.slots.get(id(p))
        if slot is None or slot[1] != nbytes:
            slot = (self.end, nbytes, values.dtype, values.shape)
            self.end += (nbytes + 4095) // 4096 * 4096
            self.slots[id(p)] = slot
        raw = values.view(torch.uint8).reshape(-1).numpy() if nbytes else b""
        view = memoryview(raw)
        done = 0
        while done < nbytes:  # short writes are retried
            done += os.pwrite(self.fd, view[done:], slot[0] + done)

    def load(self, p: torch.Tensor) -> torch.Tensor:
        offset, nbytes, dtype, shape = self.slots[id(p)]
        if self.fd < 0:
            return self.mem[id(p)]
        out = torch.empty(shape, dtype=dtype)
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"zero.Init: staging file {self.path} ended at byte {offset + done} "
                                         f"(expected {nbytes} bytes at {offset})", self.path)
            done += n
        return out

    def drop(self, p: torch.Tensor) -> None:
        self.slots.pop(id(p), None)
        self.mem.pop(id(p), None)


def _is_data_get(func) -> bool:
    """Whether the torch call `func` is the ``.data`` getter."""
    return getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) is torch._C.TensorBase.data


def _raw_data(x: torch.Tensor) -> torch.Tensor:
    """``x.data`` without any __torch_function__ (what `x` holds now)."""
    with torch._C.DisableTorchFunctionSubclass():
        return x.data


def _holds_placeholder(t: torch.Tensor) -> bool:
    return t.data_ptr() == placeholder((), t.dtype).data_ptr()


class _StagedData(torch.Tensor):
    """``p.data`` of a staged parameter: its placeholder, tied to `p` (``_tm_param``). A torch call
    given it reads and writes `p`'s staged values as a call given `p` does (``p.data.copy_(t)``,
    ``p.data.normal_()``, ``nn.init.*_(p.data)``): on the placeholder itself a write failed with
    torch's internal-overlap error and a read gave meaningless values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _init_param_torch_function(cls, func, types, args, kwargs)


def _staged_owner(x) -> Optional[torch.nn.Parameter]:
    """The staged parameter whose values the call argument `x` stands for (itself, or the owner
    of a ``p.data`` taken while it was staged), else None."""
    if isinstance(x, torch.nn.Parameter):
        st = x.__dict__.get("_tm_stage")
        return x if st is not None and id(x) in st.slots else None
    if isinstance(x, _StagedData):
        p = x.__dict__.get("_tm_param")
        if p is None:
            return None
        st = p.__dict__.get("_tm_stage")
        if st is None or id(p) not in st.slots:
            raise RuntimeError(f"tiermem.torch: this tensor is the .data of a parameter {tuple(p.shape)} {p.dtype} "
                               "taken while zero.Init staged it; initialize has taken the parameter since, so it holds "
                               "no values: use the parameter itself (inside tiermem.torch.zero.GatheredParameters to "
                               "change it)")
        return p
    return None


def _init_param_torch_function(cls, func, types, args=(), kwargs=None):
    """A parameter staged by Init (or its ``.data``), used by code that runs after its module was
    built (HF's post_init weight initialisation, tie_weights, user code): loaded for the call,
    written back after it (the call may have initialised it in place), released again. A parameter
    given ``.data = t`` since holds t: the call uses t, which is then staged in its place."""
    if kwargs is None:
        kwargs = {}
    if _is_data_get(func) and isinstance(args[0], torch.nn.Parameter):
        p = args[0]
        held = _raw_data(p)
        if _staged_owner(p) is not None and _holds_placeholder(held):
            proxy = held.as_subclass(_StagedData)
            proxy._tm_param = p
            return proxy
        return held
    staged = {}  # id(owner) -> (owner, stage, values, [arguments standing for it])
    try:
        for a in (list(args) + list(kwargs.values())) if not is_metadata(func) else ():
            items = a if isinstance(a, (list, tuple)) else (a,)
            for x in items:
                p = _staged_owner(x)
                if p is None:
                    continue
                entry = staged.get(id(p))
                if entry is None:
                    st = p._tm_stage
                    held = _raw_data(p)
                    entry = staged[id(p)] = (p, st, held if not _holds_placeholder(held) else st.load(p), [])
                if not any(x is y for y in entry[3]):
                    x.data = entry[2]
                    entry[3].append(x)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    finally:
        for p, st, values, users in staged.values():
            _, _, dtype, shape = st.slots[id(p)]
            if values.shape == shape and values.dtype == dtype:
                st.store(p, values)
                for x in users:
                    x.data = placeholder(x.shape, x.dtype)
                if not any(x is p for x in users):
                    p.data = placeholder(p.shape, p.dtype)
            else:  # `.data = t` of another shape or dtype: initialize (take_staged) names it
                for x in users:
                    if x is not p:
                        x.data = placeholder(x.shape, x.dtype)
                p.data = values


def _init_param_class(cls: type) -> type:
    return param_subclass(cls, "ZeroInit", _init_param_torch_function)


def stage_param(p: torch.nn.Parameter, stage: Stage) -> None:
    """Moves `p`'s values into `stage`: its class becomes the staged subclass of its own and its
    ``.data`` a placeholder of the right shape."""
    stage.store(p, p.data)
    p._tm_stage = stage
    p._tm_init_class = type(p)
    p.__class__ = _init_param_class(type(p))
    p.data = placeholder(p.shape, p.dtype)


def take_staged(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """For initialize(): the value Init staged for `p` (None if it was not built under Init). The
    staging keeps it until drop_staged (an initialize that fails leaves the model as it was)."""
    st = p.__dict__.get("_tm_stage")
    if st is None:
        return None
    # `p.data = t` after the build replaced the placeholder: t is the parameter's value now (the
    # staged one would silently win). Of another shape or dtype it cannot be the module's.
    _, _, dtype, shape = st.slots[id(p)]
    held = _raw_data(p)
    if not _holds_placeholder(held):
        if held.shape != shape or held.dtype != dtype:
            raise ValueError(f"tiermem.torch.initialize: a parameter built under zero.Init as {tuple(shape)} {dtype} "
                             f"was given .data of {tuple(held.shape)} {held.dtype}: give it values of its own shape and "
                             "dtype (or build the module with the shape it should have)")
        return held
    return st.load(p)


def drop_staged(p: torch.nn.Parameter) -> None:
    """After a successful initialize: the parameter gets its own class back and its staging copy
    is dropped (the staging file goes with its last one)."""
    st = p.__dict__.get("_tm_stage")
    if st is None:
        return
    st.drop(p)
    p.__class__ = p.__dict__.pop("_tm_init_class")
    del p.__dict__["_tm_stage"]
    if not st.slots and st.fd >= 0:
        st._finalizer()


def release_staging(model: torch.nn.Module) -> None:
    """After initialize: a parameter still staged by Init (every one is engine state, so only one
    that registration did not read) is dropped, and a staging that holds nothing more is closed and
    its file removed."""
    for p in model.parameters():
        if p.__dict__.get("_tm_stage") is not None:
            drop_staged(p)
    for m in model.modules():
        guard = m.__dict__.pop("_tm_init_guard", None)
        if guard is not None:
            guard.remove()


def guard_staged_module(module: torch.nn.Module) -> None:
    """A module with parameters staged by Init refuses to run its forward until initialize took
    them (release_staging removes the guard): the forward would compute on what the staging lends
    each call, not what the engine trains (it gave other outputs, silently)."""
    if "_tm_init_guard" in module.__dict__:
        return

    def refuse(mod, args):
        if any(p.__dict__.get("_tm_stage") is not None for p in mod.parameters(recurse=False)):
            raise RuntimeError(f"tiermem.torch: {type(mod).__name__} was built under tiermem.torch.zero.Init, so its "
                               "parameters are staged until tiermem.torch.initialize(model=...) takes them: call "
                               "initialize before running the model (or build it outside zero.Init)")

    module.__dict__["_tm_init_guard"] = module.register_forward_pre_hook(refuse)
