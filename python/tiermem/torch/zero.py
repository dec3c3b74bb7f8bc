"""``tiermem.torch.zero``: DeepSpeed's ``deepspeed.zero`` context managers over tiermem's engine.

``GatheredParameters(params, modifier_rank=None)``: inside, the full parameters are in ``.data``
(gathered from their tier); on exit, parameters whose values changed are written back to the
engine (``ZeroEngine::set_module_params``: fp32 master weights replaced, working copy republished,
Adam moments kept) and released. With one rank ``modifier_rank`` makes no difference.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import tempfile
import weakref
from typing import Iterable, Optional, Union

import torch

__all__ = ["GatheredParameters", "Init"]


class GatheredParameters:
    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]], modifier_rank=None,
                 fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self._held = []  # (hooks, unit, [(param, snapshot)])

    def __enter__(self):
        if not self.enabled:
            return self
        by_unit = {}
        for p in self.params:
            h = getattr(p, "_tm_hooks", None)
            if h is None or h.engine is None:
                continue  # not managed (no engine): already whole
            unit, _ = h.unit_of[id(p)]
            by_unit.setdefault((id(h), unit.index), (h, unit))
        for h, unit in by_unit.values():
            if unit.flat is None:
                # A copy: the engine keeps no pin while the parameters are shown, so its own calls
                # (a write-back, a pending update) never meet one; changes go back at exit.
                h.gather(unit, "outside", copy=True)
            unit.active += 1
            h.gathered_params_open += 1
            snaps = [(q, q.data.clone()) for q, _, _ in unit.params]
            self._held.append((h, unit, snaps))
        return self

    def __exit__(self, exc_type, exc, tb):
        held, self._held = self._held, []
        writes = []
        for h, unit, snaps in held:
            if exc_type is not None:  # nothing is written back: undo any change in place
                for q, s in snaps:
                    q.data.copy_(s)
            elif any(not torch.equal(q.data, s) for q, s in snaps):
                writes.append((h, unit, h.flat_values(unit)))
        for h, unit, _ in held:  # the gathered copy goes first: the write-back replaces it
            unit.active -= 1
            h.gathered_params_open -= 1
            if unit.active == 0:
                h._release(unit)
        for h, unit, values in writes:
            h.engine.set_module_params(unit.index, values)
        return False


# ------------------------------------------------------------------------------------- Init

# The marker of a directory tiermem made (src/nvme/made_dirs.h): the engine that last uses it
# removes it once nothing else is in it, so a closed engine leaves only what the user made.
_MADE_MARKER = ".tiermem-made"


def _make_marked_dirs(directory: str) -> None:
    """Makes `directory` and its missing parents (0700), each with the marker, as the engine's
    swap set-up does; a directory that exists is left as it is."""
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
        open(os.path.join(d, _MADE_MARKER), "w").close()


class _Stage:
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
            _make_marked_dirs(directory)
            fd, self.path = tempfile.mkstemp(prefix="tiermem-init-", suffix=".bin", dir=directory)
            self.fd = fd
            self._finalizer = weakref.finalize(self, _Stage._remove, fd, self.path)

    @staticmethod
    def _remove(fd: int, path: str) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
        try:
            os.unlink(path)
        except OSError:
            pass

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


def _init_param_torch_function(cls, func, types, args=(), kwargs=None):
    """A parameter staged by Init, used by code that runs after its module was built (HF's
    post_init weight initialisation, tie_weights, user code): loaded for the call, written back
    after it (the call may have initialised it in place), released again."""
    from ._hooks import _is_metadata, _placeholder
    if kwargs is None:
        kwargs = {}
    staged = []
    if not _is_metadata(func):
        for a in list(args) + list(kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for x in items:
                st = getattr(x, "_tm_stage", None) if isinstance(x, torch.nn.Parameter) else None
                if st is not None and id(x) in st.slots and not any(x is y for y, _ in staged):
                    x.data = st.load(x)
                    staged.append((x, st))
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    finally:
        for x, st in staged:
            st.store(x, x.data)
            x.data = _placeholder(x.shape, x.dtype)


def _init_param_class(cls: type) -> type:
    from ._hooks import param_subclass
    return param_subclass(cls, "ZeroInit", _init_param_torch_function)


def _all_module_classes() -> list:
    out, todo = [], [torch.nn.Module]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


class Init:
    """``with tiermem.torch.zero.Init(config=ds_config):`` — modules built inside never hold their
    full parameters in host memory. Each parameter is created and initialised by torch's own code
    (the same RNG stream as without Init, so losses match), and as soon as its module's
    ``__init__`` returns it goes to a staging file under the config's NVMe path (host memory when
    the config offloads nothing to NVMe), its ``.data`` a placeholder of the right shape.
    Initialisation code that runs later on the whole model (HF's ``post_init``) reaches each
    parameter through its class's ``__torch_function__``: loaded, changed in place, written back.
    ``initialize`` then registers each engine unit from the staging, one unit at a time, and the
    staging file is removed. Built outside Init, a model holds all its parameters in host memory
    until ``initialize``.

    ``config`` (or DeepSpeed's ``config_dict_or_path``): a ds_config path or dict; only its
    offload nvme_path is used here (the engine reads the rest at ``initialize``)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None, mpu=None):
        self.enabled = enabled
        self.config = config if config is not None else config_dict_or_path
        self.stage: Optional[_Stage] = None
        self._patched: list = []
        self._depth: dict[int, int] = {}
        self._saved_init_subclass = None
        self._host_budget = 0  # tiermem.host_budget_bytes of the config (0: none given)

    def _staging_dir(self) -> Optional[str]:
        if self.config is None:
            return None
        from .engine import load_config
        _, cfg = load_config(self.config, quiet=True)  # the same parser and errors as initialize
        self._host_budget = int(cfg.get("tiermem", {}).get("host_budget_bytes", 0) or 0)  # 0: the default
        z = cfg["zero_optimization"]
        for key in ("offload_param", "offload_optimizer"):
            o = z[key]
            if o["device"] == "nvme" and o["nvme_path"]:
                path = o["nvme_path"][0]
                if os.path.exists(path) and not os.path.isdir(path):
                    raise ValueError(f"zero.Init: zero_optimization.{key}.nvme_path '{path}' is not a directory")
                return path
        return None

    def __enter__(self):
        if not self.enabled:
            return self
        self.stage = _Stage(self._staging_dir())
        from .engine import _fix_malloc_threshold
        _fix_malloc_threshold(self._host_budget)  # with a small budget, the build's freed blocks go back too
        for cls in _all_module_classes():
            self._patch(cls)
        # Module classes defined inside the block are wrapped too: transformers imports a model's
        # file (GPT-2's Conv1D, ...) on the first use of its name, which is often inside it.
        ctx = self
        self._saved_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            ctx._patch(cls)

        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def _patch(self, cls) -> None:
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = self._wrap(init)
            self._patched.append((cls, init))

    def __exit__(self, exc_type, exc, tb):
        if self.enabled:
            if self._saved_init_subclass is None:
                del torch.nn.Module.__init_subclass__
            else:
                torch.nn.Module.__init_subclass__ = self._saved_init_subclass
        for cls, init in reversed(self._patched):
            cls.__init__ = init
        self._patched = []
        return False

    def _wrap(self, init):
        ctx = self

        @functools.wraps(init)
        def __init__(module, *args, **kwargs):
            key = id(module)
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            try:
                init(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
                if ctx._depth[key] == 0:
                    del ctx._depth[key]
                    ctx._stage_module(module)

        return __init__

    def _stage_module(self, module) -> None:
        from ._hooks import _placeholder
        params = getattr(module, "_parameters", None)
        if not params:
            return
        for p in params.values():
            if p is None or getattr(p, "_tm_stage", None) is not None or not p.is_floating_point():
                continue
            if p.device.type != "cpu":
                continue
            self.stage.store(p, p.data)
            p._tm_stage = self.stage
            p._tm_init_class = type(p)
            p.__class__ = _init_param_class(type(p))
            p.data = _placeholder(p.shape, p.dtype)


def take_staged(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """For initialize(): the value Init staged for `p` (None if it was not built under Init). The
    staging keeps it until drop_staged (an initialize that fails leaves the model as it was)."""
    st = p.__dict__.get("_tm_stage")
    if st is None:
        return None
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
