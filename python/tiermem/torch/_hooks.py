"""The hooks that put a torch model's parameters in tiermem's ZeroEngine: ``ParamHooks`` registers
them on a model and removes them, and each hook hands the work to the units (``_unit.py``: gather,
release, gradient buffer) and, at the end of a backward, to the next-unit predictor
(``_predictor.py``). No partitioning, paging or optimizer here: those are the engine's.

Forward. A module's pre-forward hook gathers its units (``Unit.gather``) and the post-forward hook
releases them (``Unit.release``), each parameter's ``.data`` a view of the gathered memory in
between.

Backward. While a module runs forward with autograd recording, tensors autograd saves are packed
by ``SavedParams``: a parameter, or a view of one (``nn.Linear`` saves ``weight.t()``), is saved as
(unit, size, stride, offset) instead of its memory, and unpacked when backward needs it by
gathering the unit again (phase "backward": the engine's trace prefetches it in order). Over an
outer pair of saved-tensor hooks (``torch.utils.checkpoint``'s non-reentrant forward and recompute,
``save_on_cpu``) every tensor goes to that pair, a parameter as an alias of the memory gathered at
that moment, so the outer pair keeps what it keeps and never the parameter object (which holds the
placeholder once released). Modules run again inside backward (either checkpoint variant's
recompute) gather and release as in forward.

Gradients. A hook after each trainable parameter's gradient is accumulated hands it to its unit's
fp32 gradient buffer (``Unit.accumulate_grad``) and drops ``param.grad``; the unit reduces itself
once all its gradients arrived. A callback queued on autograd's engine at the first gradient of a
backward ends the backward: units with gradients missing are reduced, and the order the pass
gathered in becomes the predictor's.

Parameters used elsewhere. Each managed parameter's class becomes a subclass of its own with a
``__torch_function__`` (``_params.param_subclass``): a torch call given a released parameter (a
tied head computed in the parent's forward, ``model.state_dict()``, a loss reading
``lm_head.weight``, user code) gathers its unit for the call, packs what autograd saves during it,
and releases the unit after; views the call returns keep the memory alive. Writes into a released
parameter, its ``.data`` and views without autograd go to the engine (``_released.py``).

Moves. ``Module.to``, ``cuda``, ``cpu`` and ``to_empty`` all run ``Module._apply``; on a managed
module it is ``ParamHooks._guarded_apply``, which refuses a move to another device before anything
changes (the engine's memory is host memory and the model computes where it was at initialize; a
parameter moved to ``meta`` has no values). Calls that leave the parameters as they are (the same
device, however spelled, and dtype) convert the buffers only; a conversion to another dtype is
refused as a move is (the engine holds the working dtype); what is no conversion of tensors runs
torch's own ``_apply``.

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

import functools
import sys

import torch

from ._params import (contiguous_stride, holds_placeholder, is_data_get, is_data_set, is_inplace, is_metadata, is_view_call, param_subclass,
                      set_raw_data)
from ._predictor import NextUnitPredictor
from ._released import (DETACH_CALLS, MEMORY_CALLS, ReleasedValues, call_tensors, first_arg, gathering_many, is_released, no_memory_error,
                        param_name, released_proxy, unaliased, view_proxy, wants_memory_of_its_own, write_through,
                        writes_released, written_args)
from ._unit import NOT_PICKLABLE, EngineLink, Unit, UnitMap, build_units, in_backward, unit_of

__all__ = ["ParamHooks"]


def _units_in(args, kwargs) -> tuple[list, bool]:
    """One pass over a call's tensor arguments (top level and one level of lists/tuples): the units
    of the managed parameters among them (each once, in order), and whether one is a proxy of a
    released parameter's values."""
    units, proxy = [], False
    for x in call_tensors(args, kwargs):
        u = unit_of(x)
        if u is not None:
            if not any(u is v for v in units):
                units.append(u)
        elif isinstance(x, ReleasedValues):
            proxy = True
    return units, proxy


def _zero_param_torch_function(cls, func, types, args=(), kwargs=None):
    """A torch call given a managed parameter. Between its module's forwards (a tied head computed in
    the parent's forward, ``model.state_dict()``, a loss reading ``lm_head.weight``, user code) the
    parameter is released: its unit is gathered for the call and released after it; views the call
    returns keep the gathered memory alive. A call that writes into a released parameter
    (``p.copy_(t)``, ``nn.init.*_(p)``, ``load_state_dict``) reaches the engine, and ``p.data`` is
    a proxy of the engine's values (``_released.py``). Outside the hooks' own saved-tensor scope,
    what autograd saves of a parameter during the call is packed by the hooks (a custom
    ``autograd.Function`` that saves the weight reads it again in backward through a gather, not
    the placeholder). ``detach()`` of a released parameter is a proxy, as ``p.data`` is (reads see
    the values of each use, writes reach the engine), except where torch's own code detaches it
    (``wants_memory_of_its_own``): ``state_dict()`` (and PEFT's ``save_pretrained``) get a copy of
    each parameter's values, tensors with memory of their own that torch.save and safetensors
    write, and so does DDP's broadcast of the module's states. What else a call returns that
    would hold the gathered memory (``p.numpy()`` of a frozen parameter) is a copy of it
    (``unaliased``): a view held past the call would keep its unit pinned in the engine's budgets
    and go stale at the next step."""
    if kwargs is None:
        kwargs = {}
    p = first_arg(args, kwargs)
    p = p if isinstance(p, torch.nn.Parameter) else None
    if is_metadata(func) or func in MEMORY_CALLS:
        if unit_of(p) is not None:
            if func in MEMORY_CALLS:
                if is_released(p):
                    raise no_memory_error(p, func)
            elif is_data_get(func) and is_released(p):
                return released_proxy(p)
            elif is_data_set(func):
                return _set_data(p, args[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if p is not None and is_released(p):
        if is_inplace(func):
            return write_through(func, args, kwargs)
        if func in DETACH_CALLS and args and args[0] is p and not wants_memory_of_its_own(sys._getframe(1)):
            return released_proxy(p)  # as p.data: the engine's values at each use, writes reaching the engine
        if args and args[0] is p and is_view_call(func) and not (torch.is_grad_enabled() and p.requires_grad):
            proxy = view_proxy(p, p, func, args[1:], kwargs)  # no autograd: writes through it must reach the engine
            if proxy is not None:
                return proxy
    units, proxy = _units_in(args, kwargs)
    written = written_args(func, args, kwargs) if units and (is_inplace(func) or "out" in kwargs) else []
    if proxy or (p is None and writes_released(written)):
        # A proxy among the arguments, or released parameters a call writes into from a list
        # (torch._foreach_mul_(params, s)): it runs on the engine's values, and what it writes is
        # stored in the engine (it changed the gathered working copy alone, the master weights
        # not, and the next step undid it).
        return write_through(func, args, kwargs)
    into = next((x for x in written if unit_of(x) is not None and not unit_of(x).copied), None) if is_inplace(func) else None
    if into is not None:
        raise RuntimeError(f"tiermem.torch: {getattr(func, '__name__', 'a call')} writes into parameter "
                           f"'{param_name(into)}' inside its module's forward, where it is the engine's gathered memory: "
                           "the change could not reach the engine's master weights. Change parameters between steps "
                           "(p.copy_(t), p.data.copy_(t), or inside tiermem.torch.zero.GatheredParameters)")
    taken = [u for u in units if u.flat is None]
    link = units[0].link if units and torch.is_grad_enabled() else None
    saved = link.saved if link is not None and link.saved is not None and not link.saved.active else None
    try:
        with gathering_many(func, taken):
            for u in taken:
                u.gather()
        with torch._C.DisableTorchFunctionSubclass():
            if saved is not None:
                with saved.hooks():
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            if taken:
                out = unaliased(out, taken)
            return out
    finally:
        for u in taken:
            if u.active == 0 and u.flat is not None:
                u.release()


def _set_data(p: torch.nn.Parameter, t) -> None:
    """``p.data = t`` by the user. Released: `t`'s values are written to the engine (as
    ``p.data.copy_(t)``), if they have the parameter's shape and dtype; otherwise nothing changes
    and ValueError says why. Gathered as a copy (GatheredParameters): torch's own assignment, which
    the scope's exit checks. Gathered by its module's forward: RuntimeError."""
    unit = unit_of(p)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tiermem.torch: parameter '{param_name(p)}'.data must be given a tensor, got {type(t).__name__}")
    if unit.flat is not None and unit.copied:
        set_raw_data(p, t)
        return None
    if unit.flat is not None:
        raise RuntimeError(f"tiermem.torch: parameter '{param_name(p)}' was given .data inside its module's forward, "
                           "where it is the engine's gathered memory; change parameters between steps")
    if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
        raise ValueError(f"tiermem.torch: parameter '{param_name(p)}' is {tuple(p.shape)} {p.dtype} in the tiermem "
                         f"engine and cannot be given .data of {tuple(t.shape)} {t.dtype}; nothing was changed. Give it "
                         "values of its own shape and dtype (p.data = t.to(p.dtype)), or change the model before "
                         "tiermem.torch.initialize")
    with torch.no_grad():  # torch's own .data assignment is no autograd operation either
        write_through(torch.Tensor.copy_, (p, t), {})
    return None


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
    if func is torch.Tensor.__repr__ and args:
        # print(p), a debugger's view: what it is, not its values (which went with the engine).
        t = args[0]
        what = "Parameter" if isinstance(t, torch.nn.Parameter) else "tensor"
        return f"<tiermem.torch: {what} of shape {tuple(t.shape)}, {t.dtype}, whose engine was closed: no values>"
    # detach() from user code gives what .data gives; torch's own (state_dict()) reads the values.
    detach = func in DETACH_CALLS and not wants_memory_of_its_own(sys._getframe(1))
    if not is_metadata(func) and not detach:
        raise RuntimeError(f"tiermem.torch: {CLOSED}")
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
        # .data (and detach()) is the placeholder: as a plain tensor every read of it (EMA code
        # reading p.data, an export) would compute NaN without a word; it refuses them as the
        # parameter does, and says what it is.
        return out.as_subclass(ClosedData) if is_data_get(func) or detach else out


class ClosedData(torch.Tensor):
    """``p.data`` of a parameter whose engine was closed: its shape and dtype answer, every call
    that reads its values raises RuntimeError (CLOSED), as the parameter itself does."""

    __torch_function__ = classmethod(_closed_param_torch_function)


def _zero_param_class(cls: type) -> type:
    return param_subclass(cls, "Zero", _zero_param_torch_function)


class _Saved:
    """A saved parameter (or view of one): its unit and where in the unit's gathered memory it is."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: Unit, size, stride, offset: int) -> None:
        self.unit = unit
        self.size = size
        self.stride = stride
        self.offset = offset

    @staticmethod
    def of_param(unit: Unit, p: torch.nn.Parameter) -> "_Saved":
        """The parameter itself, by its slot in the unit (not by what it holds now: a parameter
        saved while released, as a custom autograd.Function given it outside a gather saves it,
        holds its placeholder)."""
        i, off, _ = unit.slot_of[id(p)]
        shape = unit.shapes[i]
        return _Saved(unit, shape, contiguous_stride(shape), off)

    @staticmethod
    def of_view(unit: Unit, t: torch.Tensor) -> "_Saved":
        return _Saved(unit, t.size(), t.stride(), t.storage_offset())


class SavedParams:
    """What autograd saves of a managed parameter, while the model's forward runs (and, outside it,
    during a torch call given a parameter): ``hooks()`` is a ``saved_tensors_hooks`` scope.

    On its own (no saved-tensor hook entered before it), a parameter or a view of one is saved as
    (unit, size, stride, offset) instead of its memory and unpacked by gathering the unit again
    (``Unit.backward_flat``). Over an outer pair of hooks (torch.utils.checkpoint's, either pass of
    the non-reentrant variant; ``torch.autograd.graph.save_on_cpu``; a user's own) every tensor goes
    to that pair, so its bookkeeping and savings stay whole, but a parameter itself is handed over
    as an alias of the memory gathered now: the checkpoint's recompute keeps a frozen weight by
    reference, and the parameter object holds the placeholder once released (the gradients of a
    PEFT model under transformers' default checkpointing were 18-94 % off, silently)."""

    def __init__(self, units: UnitMap) -> None:
        self.unit_of = units.unit_of
        self.active = 0  # scopes entered now

    def hooks(self) -> "_SavedScope":
        return _SavedScope(self)

    def is_param(self, t: torch.Tensor) -> bool:
        hit = self.unit_of.get(id(t))
        return hit is not None and hit[1] is t

    def pack(self, t: torch.Tensor):
        unit_of = self.unit_of
        hit = unit_of.get(id(t))
        if hit is not None and hit[1] is t:
            return _Saved.of_param(hit[0], t)
        base = t._base
        if base is None:
            return t
        hit = unit_of.get(id(base))
        if hit is None or hit[1] is not base:
            return t
        if holds_placeholder(t):  # a view made of the placeholder, not of gathered memory
            raise RuntimeError(f"tiermem.torch: autograd saved a view of parameter '{param_name(base)}' made while it "
                               "was released (its placeholder, not its values); this path is not known to tiermem: "
                               "please report it")
        return _Saved.of_view(hit[0], t)

    @staticmethod
    def unpack(s):
        if not isinstance(s, _Saved):
            return s
        return s.unit.backward_flat().as_strided(s.size, s.stride, s.offset)

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, or for a managed parameter an alias of its gathered values (gathered for the call
        when it is released: a custom autograd.Function given it saves it so)."""
        if not self.is_param(t):
            return t
        unit = self.unit_of[id(t)][0]
        taken = unit.flat is None
        if taken:
            unit.gather()
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return t.detach()
        finally:
            if taken and unit.active == 0:
                unit.release()


class _SavedScope:
    """One entered scope of SavedParams (chained over the pair of hooks on top when it is entered)."""

    __slots__ = ("owner", "ctx")

    def __init__(self, owner: SavedParams) -> None:
        self.owner = owner
        self.ctx = None

    def __enter__(self):
        owner = self.owner
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:
            self.ctx = torch.autograd.graph.saved_tensors_hooks(owner.pack, owner.unpack)
        else:
            outer_pack, outer_unpack = outer
            alias = owner.alias
            self.ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: outer_pack(alias(t)), outer_unpack)
        self.ctx.__enter__()
        owner.active += 1
        return self

    def __exit__(self, *exc):
        self.owner.active -= 1
        ctx, self.ctx = self.ctx, None
        ctx.__exit__(*exc)
        return False


class ParamHooks:
    """The hooks of one model: made over its units (``units``: a ``_unit.UnitMap``), registered by
    ``attach`` and removed by ``detach``. Each hook delegates to the units and the predictor."""

    def __init__(self, model: torch.nn.Module, leaf_types: tuple = ()) -> None:
        self.model = model
        self.predictor = NextUnitPredictor()
        self.link = EngineLink(model, [], self.predictor)
        self.units: UnitMap = build_units(model, leaf_types, self.link)
        self.saved = SavedParams(self.units)
        self.link.saved = self.saved
        self.handles: list = []
        self.guarded: list = []  # modules whose _apply is _guarded_apply
        self.saved_ctx = None  # the SavedParams scope of the outermost module running
        # The modules running forward now, outermost first: [id(module), units it acquired, whether
        # its pre-forward hook finished]. torch runs a post-forward hook (always_call) for each
        # pre-forward one, Exceptions included, but for no BaseException (KeyboardInterrupt): the
        # entries such a forward leaves are unwound at the model's next forward or step().
        self.running: list[list] = []
        self.wrapped_forward = None  # (the model's wrapped forward, its instance forward before) while attached
        self.backward_pending = False
        self.on_backward = None  # called once per backward that produced a gradient

    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_PICKLABLE)

    @property
    def depth(self) -> int:
        """Modules running forward now."""
        return len(self.running)

    # ------------------------------------------------------------------------------ what the engine asks
    def unit_list(self) -> list:
        """The model's units in engine order."""
        return self.units.units

    def is_param(self, t) -> bool:
        """Whether `t` is one of the model's managed parameters."""
        return self.saved.is_param(t)

    def gathered_scopes_open(self) -> int:
        """zero.GatheredParameters scopes open on this model now."""
        return self.link.gathered_params_open

    def dist_ops(self):
        """The collectives' module check (_dist.DistOps) with several ranks, else None."""
        return self.link.dist_ops

    # ------------------------------------------------------------------------------ attach / detach
    def attach(self, engine, working_dtype: torch.dtype, dist_ops=None, forward_only: bool = False) -> None:
        """Points the units at `engine` (with several ranks, `dist_ops`: the collectives' module
        check), releases every unit, and registers the hooks: forward pre/post on every module, a
        post-accumulate-grad hook and the managed class on every trainable parameter. With
        `forward_only` (nothing to train) each forward of the model, in any mode, is one traced pass
        of the engine (``ZeroEngine.end_forward_pass`` at its end)."""
        link = self.link
        link.engine = engine
        link.working_dtype = working_dtype
        link.dist_ops = dist_ops
        link.forward_only = forward_only
        for u in self.units.units:
            u.release()
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))
            # Set in the instance's __dict__ (shadowing its class's method), not a class swap: the
            # module keeps its type.
            module.__dict__["_apply"] = functools.partial(self._guarded_apply, module, name)
            self.guarded.append(module)
        self._wrap_model_forward()
        for u in self.units.units:
            for p, _, _ in u.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                p._tm_original_class = type(p)
                p.__class__ = _zero_param_class(type(p))
                p._tm_unit = u

    def _wrap_model_forward(self) -> None:
        """The model's forward, in its instance's __dict__ (as ``_apply``), wrapped so that a
        BaseException that is not an Exception (KeyboardInterrupt) leaving it unwinds what the
        forwards inside held at once (``unwind_interrupted``): torch runs no post-forward hook for
        one, and until the next forward or step the interrupted modules counted as running (a
        write between steps then changed the gathered working copy alone, or was refused as made
        inside a forward). ``functools.wraps`` keeps its signature (the HF Trainer reads it)."""
        model = self.model
        inner = model.forward  # the bound method, or a forward someone set on the instance

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except Exception:
                raise  # the post-forward hooks run (always_call) and leave as usual
            except BaseException:
                self.unwind_interrupted()
                raise
        self.wrapped_forward = (forward, model.__dict__.get("forward"))
        model.__dict__["forward"] = forward

    def _unwrap_model_forward(self) -> None:
        if self.wrapped_forward is None:
            return
        forward, before = self.wrapped_forward
        self.wrapped_forward = None
        if self.model.__dict__.get("forward") is forward:  # not replaced since
            if before is None:
                del self.model.__dict__["forward"]
            else:
                self.model.__dict__["forward"] = before

    def release_all(self) -> None:
        """Releases every unit still in use. A forward ended by a BaseException that is not an
        Exception (KeyboardInterrupt: torch runs its always-call post-forward hooks for Exceptions
        only) leaves its modules' units gathered; their memory keeps the engine, and so its swap
        files, alive after close(); so do open zero.GatheredParameters scopes."""
        self.unwind_interrupted()
        for u in self.units.units:
            if u.active or u.flat is not None:
                u.active = 0
                u.release()

    def unwind_interrupted(self) -> None:
        """Drops what forwards that a BaseException ended (KeyboardInterrupt: no post-forward hook
        ran) still hold: each running module's acquired units (the last user releases its unit), the
        saved-tensor hooks they entered. Called where no forward can be running: at the model's
        next forward (its pre-forward hook, with modules still marked running) and at step().
        Without it the units stayed gathered: the next forwards computed with that gathered memory
        after step() had changed the weights, and with the engine's parameters on the device the
        step itself failed (their memory pinned). zero.GatheredParameters scopes keep theirs."""
        while self.running:
            _, done, _ = self.running.pop()
            for u in done:
                u.drop()
        self.link.running = 0
        self._end_saved_scope()

    def _end_saved_scope(self) -> None:
        if self.saved_ctx is not None:
            ctx, self.saved_ctx = self.saved_ctx, None
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - already popped (the interrupted forward's own exit)
                pass

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
        self._unwrap_model_forward()
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
        where = f"{type(module).__name__} ({name!r})" if name else f"the model ({type(module).__name__})"
        raise RuntimeError(f"tiermem.torch: converting {where} to {probe.dtype} after initialize is refused, nothing was "
                           f"changed: the tiermem engine holds its parameters in {self.link.working_dtype}. Choose the "
                           "precision in the config (\"bf16\": {\"enabled\": true} or \"fp16\"), or convert the model "
                           "before initialize; under torch.autocast the parameters stay as they are")

    # ------------------------------------------------------------------------------ forward
    def _pre_forward(self, module, args):
        if module is self.model and self.running:
            self.unwind_interrupted()  # the model is not inside its own forward: those were interrupted
        if self.depth == 0:
            self.forget_failed_backward()
        if self.depth == 0 and torch.is_grad_enabled():
            self.saved_ctx = self.saved.hooks()
            self.saved_ctx.__enter__()
        entry = [id(module), [], False]
        self.running.append(entry)
        self.link.running = self.depth
        units = self.units.module_units.get(id(module))
        if units:
            done = entry[1]
            try:
                for u in units:
                    u.acquire()
                    done.append(u)
            except BaseException:
                # The forward will not run, but its post-forward hook does (always_call): it leaves,
                # and must not drop the units this call did not acquire.
                for u in done:
                    u.drop()
                done.clear()
                raise
        entry[2] = True

    def _post_forward(self, module, args, output):
        # This module's entry; any above it are calls inside its forward that a BaseException ended
        # and its forward caught: theirs are dropped too.
        ended = False  # its pre-forward hook finished (else the forward never ran)
        while self.running:
            mid, done, ok = self.running.pop()
            for u in done:
                u.drop()
            if mid == id(module):
                ended = ok
                break
        self._leave(module if ended else None)
        return None

    def _leave(self, module=None) -> None:
        self.link.running = self.depth
        if self.depth == 0 and self.saved_ctx is not None:
            ctx, self.saved_ctx = self.saved_ctx, None
            ctx.__exit__(None, None, None)
        if self.depth == 0 and self.link.forward_only and module is self.model and self.link.engine is not None:
            # The model's forward ended: one pass of a forward-only engine's trace (generate()
            # runs one per token; the next pass's reads go ahead, evictions by next use).
            self.link.engine.end_forward_pass()
            if self.link.predictor is not None:
                self.link.predictor.end_pass()  # this forward's order predicts the next one's

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
