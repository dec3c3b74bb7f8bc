"""``tiermem.torch.zero``: DeepSpeed's ``deepspeed.zero`` context managers over tiermem's engine.

``GatheredParameters(params, modifier_rank=None)``: inside, the full parameters are in ``.data``
(gathered from their tier); on exit, parameters whose values changed are written back to the
engine (``ZeroEngine::set_module_params``: fp32 master weights replaced, working copy republished,
Adam moments kept) and released. With one rank ``modifier_rank`` makes no difference.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Optional, Union

import torch

from ._config import load_config
from ._malloc import fix_malloc_threshold
from ._init_store import InitStore, guard_stored_module, store_param
from ._unit import unit_of

__all__ = ["GatheredParameters", "Init"]


class GatheredParameters:
    def __init__(self, params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]], modifier_rank=None,
                 fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        try:
            self.params = [p for p in params if p is not None]
        except TypeError:
            raise TypeError(f"GatheredParameters: params must be a parameter or an iterable of parameters, got "
                            f"{type(params).__name__}") from None
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GatheredParameters: params[{i}] is a {type(p).__name__}, not a parameter")
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self._held = []  # (unit, [(param, snapshot)])

    def __enter__(self):
        if not self.enabled:
            return self
        units = {}
        for p in self.params:
            unit = unit_of(p)
            if unit is None:
                continue  # not managed (frozen, or no engine): already whole
            units.setdefault(id(unit), unit)
        for unit in units.values():
            # A copy: the engine keeps no pin while the parameters are shown, so its own calls (a
            # write-back, a pending update) never meet one; changes go back at exit.
            unit.acquire("outside", copy=True)
            unit.link.gathered_params_open += 1
            snaps = [(q, q.data.clone()) for q, _, _ in unit.params]
            self._held.append((unit, snaps))
        return self

    def __exit__(self, exc_type, exc, tb):
        held, self._held = self._held, []
        writes = []
        # A parameter given another shape or dtype inside cannot be written back into its unit.
        reshaped = [(unit, i, tuple(q.data.shape), q.data.dtype, s) for unit, snaps in held
                    for i, (q, s) in enumerate(snaps) if q.data.shape != s.shape or q.data.dtype != s.dtype]
        for unit, snaps in held:
            if exc_type is not None or reshaped:  # nothing is written back: undo any change
                for q, s in snaps:
                    if q.data.shape != s.shape or q.data.dtype != s.dtype:
                        q.data = s
                    else:
                        q.data.copy_(s)
            elif any(not torch.equal(q.data, s) for q, s in snaps):
                writes.append((unit, unit.flat_values()))
        for unit, _ in held:  # the gathered copy goes first: the write-back replaces it
            unit.drop()
            unit.link.gathered_params_open -= 1
        for unit, values in writes:
            unit.set_values(values)
        if reshaped and exc_type is None:
            unit, i, shape, dtype, snap = reshaped[0]
            raise ValueError(f"GatheredParameters: parameter {i} of {unit.name!r} was set to shape {shape} "
                             f"{dtype} inside the block, but it is {tuple(snap.shape)} {snap.dtype}: write values of "
                             "its own shape and dtype into it (p.data.copy_(...)); nothing was written back")
        return False


# ------------------------------------------------------------------------------------- Init

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
    ``__init__`` returns it goes to a Init store file under the config's NVMe path (host memory when
    the config offloads nothing to NVMe), its ``.data`` a placeholder of the right shape.
    Initialisation code that runs later on the whole model (HF's ``post_init``) reaches each
    parameter through its class's ``__torch_function__``: loaded, changed in place, written back.
    ``initialize`` then registers each engine unit from the Init store, one unit at a time, and the
    Init store file is removed (a model that never reaches ``initialize`` takes the file, and the
    directories made for it, with it when it is collected, or at interpreter exit). Built outside
    Init, a model holds all its parameters in host memory until ``initialize``.

    ``config`` (or DeepSpeed's ``config_dict_or_path``): a ds_config path or dict; only its
    offload nvme_path is used here (the engine reads the rest at ``initialize``)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None, mpu=None):
        self.enabled = enabled
        self.config = config if config is not None else config_dict_or_path
        self.store: Optional[InitStore] = None
        self._patched: list = []
        self._depth: dict[int, int] = {}
        self._saved_init_subclass = None
        self._host_budget = 0  # tiermem.host_budget_bytes of the config (0: none given)
        self._store_key = ""  # the config key that gave the Init store its directory

    def _store_dir(self) -> Optional[str]:
        if self.config is None:
            return None
        _, cfg = load_config(self.config, quiet=True)  # the same parser and errors as initialize
        self._host_budget = int(cfg.get("tiermem", {}).get("host_budget_bytes", 0) or 0)  # 0: the default
        z = cfg["zero_optimization"]
        for key in ("offload_param", "offload_optimizer"):
            o = z[key]
            if o["device"] == "nvme" and o["nvme_path"]:
                path = o["nvme_path"][0]
                if os.path.exists(path) and not os.path.isdir(path):
                    raise ValueError(f"zero.Init: zero_optimization.{key}.nvme_path '{path}' is not a directory")
                self._store_key = f"zero_optimization.{key}.nvme_path"
                return path
        return None

    def __enter__(self):
        if not self.enabled:
            return self
        directory = self._store_dir()
        try:
            self.store = InitStore(directory)
        except OSError as e:  # a directory that cannot be made or written: say which key gave it
            raise OSError(e.errno, f"zero.Init: cannot make the Init store under {self._store_key} '{directory}': "
                                   f"{e.strerror or e}; give a directory this user can create and write",
                          directory) from e
        fix_malloc_threshold(self._host_budget)  # with a small budget, the build's freed blocks go back too
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
        # The Init store lives as long as the parameters it holds (each references it), not as long
        # as this object: the file and the directories made for it go when the model does.
        self.store = None
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
                    ctx._store_module(module)

        return __init__

    def _store_module(self, module) -> None:
        params = getattr(module, "_parameters", None)
        if not params:
            return
        for p in params.values():
            if p is None or getattr(p, "_tm_init_store", None) is not None or not p.is_floating_point():
                continue
            if p.device.type != "cpu":
                continue
            store_param(p, self.store)
            guard_stored_module(module)
