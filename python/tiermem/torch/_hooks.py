"""The hooks that put a torch model's parameters in tiermem's ZeroEngine: ``ParamHooks`` registers
them on a model and removes them, and each hook hands the work to the units (``_unit.py``: gather,
release, gradient buffer) and, at the end of a backward, to the next-unit predictor
(``_predictor.py``). No partitioning, paging or optimizer here: those are the engine's.

Forward. A module's pre-forward hook gathers its units (``Unit.gather``) and the post-forward hook
releases them (``Unit.release``), each parameter's ``.data`` a view of the gathered memory in
between.

Backward. While a module runs forward with autograd recording, tensors autograd saves are packed
by ``saved_tensors_hooks``: a parameter, or a view of one (``nn.Linear`` saves ``weight.t()``), is
saved as (unit, size, stride, offset) instead of its memory, and unpacked when backward needs it
by gathering the unit again (phase "backward": the engine's trace prefetches it in order). Modules
run again inside backward (``torch.utils.checkpoint``'s recompute) gather and release as in
forward: the reentrant variant's saves are packed the same way, the non-reentrant one keeps its
own references to what it saves (which hold the gathered memory until its backward is done).

Gradients. A hook after each trainable parameter's gradient is accumulated hands it to its unit's
fp32 gradient buffer (``Unit.accumulate_grad``) and drops ``param.grad``; the unit reduces itself
once all its gradients arrived. A callback queued on autograd's engine at the first gradient of a
backward ends the backward: units with gradients missing are reduced, and the order the pass
gathered in becomes the predictor's.

Parameters used elsewhere. Each managed parameter's class becomes a subclass of its own with a
``__torch_function__`` (``_params.param_subclass``): a torch call given a released parameter (a
tied head computed in the parent's forward, ``model.state_dict()``, user code) gathers its unit for
the call and releases it after; views the call returns keep the memory alive.

Moves. ``Module.to``, ``cuda``, ``cpu`` and ``to_empty`` all run ``Module._apply``; on a managed
module it is ``ParamHooks._guarded_apply``, which refuses a move to another device before anything
changes (the engine's memory is host memory and the model computes where it was at initialize; a
parameter moved to ``meta`` has no values). Calls that leave the parameters as they are (the same
device, however spelled, and dtype) convert the buffers only; others run torch's own ``_apply``.

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

import functools

import torch

from ._params import is_metadata, param_subclass
from ._predictor import NextUnitPredictor
from ._unit import NOT_PICKLABLE, EngineLink, Unit, UnitMap, build_units, in_backward

__all__ = ["ParamHooks"]


def _gather_released(args, kwargs) -> list:
    """Gathers the units of released parameters among the call's arguments (top level and one
    level of lists/tuples); returns the units to release after the call."""
    taken = []

    def visit(a):
        u = getattr(a, "_tm_unit", None) if isinstance(a, torch.nn.Parameter) else None
        if u is not None and u.flat is None:
            u.gather()
            taken.append(u)

    for a in args:
        if isinstance(a, (list, tuple)):
            for b in a:
                visit(b)
        else:
            visit(a)
    for a in kwargs.values():
        visit(a)
    return taken


def _zero_param_torch_function(cls, func, types, args=(), kwargs=None):
    """A parameter used while released (outside its module's forward: a tied head computed in the
    parent's forward, ``model.state_dict()``, user code) is gathered for the call and released
    after it; views the call returns keep the gathered memory alive, and autograd's saves of it
    are packed as usual. ``detach()`` of a released parameter returns a copy, not a view: it is
    how ``state_dict()`` (and PEFT's ``save_pretrained``) read every parameter, and a view each
    would keep every unit gathered, and pinned in the engine's budgets, at once."""
    if kwargs is None:
        kwargs = {}
    taken = () if is_metadata(func) else _gather_released(args, kwargs)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if taken and func is torch.Tensor.detach:
                out = out.clone()
            return out
    finally:
        for u in taken:
            if u.active == 0:
                u.release()


def _device_key(d: torch.device) -> tuple:
    """(type, index) of `d`, the index torch means when it names none: "cpu" and "cpu:0" are one
    device, as are "cuda" and "cuda:<current>"."""
    d = torch.device(d)
    if d.index is not None:
        return d.type, d.index
    if d.type == "cuda" and torch.cuda.is_available():
        return d.type, torch.cuda.current_device()
    return d.type, 0


def _same_device(a: torch.device, b: torch.device) -> bool:
    return _device_key(a) == _device_key(b)


def _apply_to_buffers(module: torch.nn.Module, fn, recurse: bool) -> torch.nn.Module:
    """``module._apply(fn, recurse)`` for a conversion the managed parameters need nothing of: the
    submodules' ``_apply`` (guarded ones come back here), then `fn` on this module's buffers, as
    torch's ``_apply`` does; the parameters are left as they are."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


CLOSED = ("this model's parameters were in a tiermem engine that has been closed, and their values went with it; "
          "build the model again (or load a checkpoint / save_fp32_model file into a new one), and save values "
          "before close() (engine.save_fp32_model, or GatheredParameters)")


def _closed_param_torch_function(cls, func, types, args=(), kwargs=None):
    if not is_metadata(func):
        raise RuntimeError(f"tiermem.torch: {CLOSED}")
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def _zero_param_class(cls: type) -> type:
    return param_subclass(cls, "Zero", _zero_param_torch_function)


class _Saved:
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: Unit, t: torch.Tensor) -> None:
        self.unit = unit
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


class ParamHooks:
    """The hooks of one model: made over its units (``units``: a ``_unit.UnitMap``), registered by
    ``attach`` and removed by ``detach``. Each hook delegates to the units and the predictor."""

    def __init__(self, model: torch.nn.Module, leaf_types: tuple = ()) -> None:
        self.model = model
        self.predictor = NextUnitPredictor()
        self.link = EngineLink(model, [], self.predictor)
        self.units: UnitMap = build_units(model, leaf_types, self.link)
        self.handles: list = []
        self.guarded: list = []  # modules whose _apply is _guarded_apply
        self.saved_ctx = None  # the saved_tensors_hooks context of the outermost module running
        self.depth = 0  # modules running forward now
        self.failed_pre: set = set()  # id() of modules whose pre-forward hook raised (their post hook still runs)
        self.backward_pending = False
        self.on_backward = None  # called once per backward that produced a gradient

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLABLE)

    # ------------------------------------------------------------------------------ attach / detach
    def attach(self, engine, working_dtype: torch.dtype, dist_ops=None) -> None:
        """Points the units at `engine` (with several ranks, `dist_ops`: the collectives' module
        check), releases every unit, and registers the hooks: forward pre/post on every module, a
        post-accumulate-grad hook and the managed class on every trainable parameter."""
        link = self.link
        link.engine = engine
        link.working_dtype = working_dtype
        link.dist_ops = dist_ops
        for u in self.units.units:
            u.release()
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))
            # Set in the instance's __dict__ (shadowing its class's method), not a class swap: the
            # module keeps its type.
            module.__dict__["_apply"] = functools.partial(self._guarded_apply, module, name)
            self.guarded.append(module)
        for u in self.units.units:
            for p, _, _ in u.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                p._tm_original_class = type(p)
                p.__class__ = _zero_param_class(type(p))
                p._tm_unit = u

    def release_all(self) -> None:
        """Releases every unit still in use. A forward ended by a BaseException that is not an
        Exception (KeyboardInterrupt: torch runs its always-call post-forward hooks for Exceptions
        only) leaves its modules' units gathered; their memory keeps the engine, and so its swap
        files, alive after close(). Also ends the saved-tensor hooks such a forward left entered."""
        for u in self.units.units:
            if u.active or u.flat is not None:
                u.active = 0
                u.release()
        if self.saved_ctx is not None:
            ctx, self.saved_ctx = self.saved_ctx, None
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - already popped (the interrupted forward's own exit)
                pass
        self.depth = 0

    def mark_closed(self) -> None:
        """After detach at close(): each parameter (a placeholder, its values gone with the engine)
        refuses every call that reads its values, which would read zeros without a word
        (``state_dict()``, ``initialize`` of the model again); its shape and dtype still answer."""
        for u in self.units.units:
            for p, _, _ in u.params:
                p.__class__ = param_subclass(type(p), "Closed", _closed_param_torch_function)

    def detach(self) -> None:
        """Removes every hook; the parameters get their own class back."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for module in self.guarded:
            module.__dict__.pop("_apply", None)
        self.guarded = []
        for u in self.units.units:
            for p, _, _ in u.params:
                cls = p.__dict__.pop("_tm_original_class", None)
                if cls is not None:
                    p.__class__ = cls
                p.__dict__.pop("_tm_unit", None)

    # ------------------------------------------------------------------------------ moves
    def _guarded_apply(self, module: torch.nn.Module, name: str, fn, recurse: bool = True):
        """``module._apply(fn)`` (what ``.to()``, ``.cuda()``, ``.cpu()``, ``.to_empty()`` run): `fn`
        is tried on an empty tensor where the model computes, and a move to another device is
        refused before any parameter or buffer changes. torch's own ``_apply`` would convert each
        parameter (gathering it), put new Parameter objects in the modules, and move the buffers:
        modules of one parameter were left on the new device unseen, and the buffers stayed there
        after the undo at the next gather (torch's device error at every later step).

        A call that leaves a tensor of the model's working dtype on its device as it is (``.to()``
        of the same device however spelled: "cpu", "cpu:0", ``torch.device("cpu", 0)``; ``.float()``
        of an fp32 model; ``to_empty(device=<the same>)``) needs nothing of the managed parameters:
        they are not touched (the engine keeps their values; torch's ``_apply`` gathered each one and
        put the gathered memory in ``.data``, which the next gather undid with a RuntimeError), and
        the buffers get what `fn` gives them, as without tiermem (a dtype change, or for
        ``to_empty`` uninitialised memory)."""
        dev = self.link.compute_device
        try:
            with torch.no_grad():
                probe = fn(torch.empty(0, dtype=self.link.working_dtype, device=dev))
        except Exception:  # noqa: BLE001 - not a conversion of plain tensors: torch's _apply decides
            probe = None
        if not isinstance(probe, torch.Tensor):
            return type(module)._apply(module, fn, recurse)
        if not _same_device(probe.device, dev):
            where = f"{type(module).__name__} ({name!r})" if name else f"the model ({type(module).__name__})"
            raise RuntimeError(f"tiermem.torch: moving {where} to {probe.device} after initialize is refused, nothing "
                               f"was moved: the model's parameters are in the tiermem engine, and the model computes "
                               f"on {dev}. Put the model on its device before initialize (build it there, or "
                               "model.to(device) first); to take it out of the engine, write it with "
                               "engine.save_fp32_model(path), close() the engine and load the file into a model on the "
                               "new device")
        if probe.dtype == self.link.working_dtype:
            return _apply_to_buffers(module, fn, recurse)
        return type(module)._apply(module, fn, recurse)

    # ------------------------------------------------------------------------------ forward
    def _saved_hooks_wanted(self) -> bool:
        """Pack parameters for backward unless another saved-tensor hook already owns this region:
        non-reentrant activation checkpointing's recompute keeps its own (detached) references to
        what it saves, which hold the gathered memory for as long as its backward needs it."""
        if not torch.is_grad_enabled():
            return False
        if in_backward():
            return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        return True

    def _pre_forward(self, module, args):
        if self.depth == 0:
            self.forget_failed_backward()
        if self.depth == 0 and self._saved_hooks_wanted():
            self.saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saved_ctx.__enter__()
        self.depth += 1
        units = self.units.module_units.get(id(module))
        if units:
            done = []
            try:
                for u in units:
                    u.acquire()
                    done.append(u)
            except BaseException:
                # The forward will not run, but its post-forward hook does (always_call): it leaves,
                # and must not drop the units this call did not acquire.
                for u in done:
                    u.drop()
                self.failed_pre.add(id(module))
                raise

    def _post_forward(self, module, args, output):
        if id(module) in self.failed_pre:
            self.failed_pre.discard(id(module))
            self._leave()
            return None
        units = self.units.module_units.get(id(module))
        if units:
            for u in units:
                u.drop()
        self._leave()
        return None

    def _leave(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.saved_ctx is not None:
            ctx, self.saved_ctx = self.saved_ctx, None
            ctx.__exit__(None, None, None)

    # ------------------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        unit_of = self.units.unit_of
        hit = unit_of.get(id(t))
        if hit is None or hit[1] is not t:
            base = t._base
            if base is None:
                return t
            hit = unit_of.get(id(base))
            if hit is None or hit[1] is not base:
                return t
        return _Saved(hit[0], t)

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        return s.unit.backward_flat().as_strided(s.size, s.stride, s.offset)

    # ------------------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        unit, _ = self.units.unit_of[id(p)]
        g = p.grad
        p.grad = None
        if g is None:
            return
        self._queue_end_of_backward()
        unit.accumulate_grad(p, g)

    def forget_failed_backward(self) -> None:
        """A backward that raised never ran its end-of-backward callback: outside backward, one still
        pending is forgotten, with the units' partial gradient buffers (what was reduced before the
        error stays in the engine, as torch keeps the .grad a failed backward accumulated)."""
        if self.backward_pending and not in_backward():
            self.backward_pending = False
            for u in self.units.units:
                u.forget_backward()

    def _queue_end_of_backward(self) -> None:
        if not self.backward_pending:
            self.backward_pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self.on_backward is not None:
                self.on_backward()

    def _end_of_backward(self) -> None:
        self.backward_pending = False
        self.predictor.end_pass()
        for u in self.units.units:
            u.end_backward()
