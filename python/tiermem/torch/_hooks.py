"""The hooks that put a torch model's parameters in tiermem's ZeroEngine (no partitioning, paging
or optimizer here: those are the engine's).

Units. Each module that directly owns trainable parameters (``module._parameters``) is one engine
module ("unit"): its parameters flattened, in registration order, into one fp32 vector. A module
marked as a leaf (``set_z3_leaf_modules``: DeepSpeed's ``_z3_leaf`` attribute) is one unit with
every parameter of its subtree, and its children get no hooks. A parameter that appears again
(tied weights: GPT-2's ``lm_head.weight`` is ``wte.weight``) belongs to the first unit that holds
it; every other module that holds it gathers that unit too. Frozen parameters
(``requires_grad=False`` when ``initialize`` runs: PEFT freezes the base after the model is built)
are engine state too, in units of their own: a module with both gets a trainable unit and a frozen
one. A frozen unit is paged, gathered, released and prefetched like any other, in the working
dtype, but the engine keeps no master weights, gradient or optimizer state for it and never writes
it back; backward gathers it again only when autograd unpacks a saved view of it (the input
gradient of a frozen Linear).

Between uses, a parameter's ``.data`` is a placeholder: a zero-stride expansion of one element, so
``param.shape`` stays true but the parameter holds no memory. Reading it then gives meaningless
values, writing it fails.

Forward. A module's pre-forward hook gathers its units (``ZeroEngine.gather``: stage 3 pins the
shard, or all-gathers it, loading it from its home tier ahead of time by the engine's recorded
trace) and points each parameter's ``.data`` at its slice of the gathered memory: a view, no copy.
The post-forward hook puts the placeholders back. The gathered memory itself is freed by torch's
reference counting (the engine's scope ends when the storage does), so a view that autograd or the
user kept stays valid, and no view can outlive the memory.

Backward. While a module runs forward with autograd recording, tensors autograd saves are packed
by ``saved_tensors_hooks``: a parameter, or a view of one (``nn.Linear`` saves ``weight.t()``), is
saved as (unit, size, stride, offset) instead of its memory, and unpacked when backward needs it
by gathering the unit again (phase "backward": the engine's trace prefetches it in order). Modules
run again inside backward (``torch.utils.checkpoint``'s recompute) gather and release as in
forward: the reentrant variant's saves are packed the same way, the non-reentrant one keeps its
own references to what it saves (which hold the gathered memory until its backward is done).

Gradients. A hook after each trainable parameter's gradient is accumulated copies it into its
unit's fp32 gradient buffer and drops ``param.grad`` (a unit of one fp32 parameter takes
autograd's gradient itself as its buffer: no copy); when every trainable parameter of the unit
has arrived, the buffer goes to ``ZeroEngine.reduce_gradients`` (the engine's reduce path: the
reduce-scatter and the accumulation into its gradient partitions), while backward goes on with
the modules before it. A unit whose parameters did not all get a gradient is reduced when the
backward ends. The engine sums what it is given (mean_over_micro_batches false): torch's
convention.

Parameters used elsewhere. Each managed parameter's class becomes a subclass of its own with a
``__torch_function__``: a torch call given a released parameter (a tied head computed in the
parent's forward, ``model.state_dict()``, user code) gathers its unit for the call and releases it
after; views the call returns keep the memory alive.

CUDA. A model on a CUDA device computes on copies: each gathered unit is copied from the engine's
(host) memory to the device when it is gathered, the parameters view that copy, and torch's
caching allocator owns it (so stream ordering is torch's own). Gradients are copied out to the
unit's fp32 host buffer. This is the same data flow as tiermem-train's CUDA backend, which copies
each module in per step; it has not been run on a GPU yet (the CPU tests force the copy path with
``copy_in``).

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    key = (dtype, device)
    base = _PLACEHOLDERS.get(key)
    if base is None:
        base = torch.zeros((), dtype=dtype, device=device)
        _PLACEHOLDERS[key] = base
    return base.expand(shape)


class Unit:
    """One engine module: parameters laid out back to back in one flat vector."""

    __slots__ = ("index", "name", "frozen", "params", "slot_of", "numel", "flat", "active", "n_trainable", "grad",
                 "received", "got", "bw_flat")

    def __init__(self, index: int, name: str, frozen: bool = False) -> None:
        self.index = index
        self.name = name
        self.frozen = frozen  # every parameter has requires_grad False: no gradient, no optimizer state
        self.params: list[tuple[torch.nn.Parameter, int, int]] = []  # (param, offset, numel)
        self.slot_of: dict[int, tuple[int, int, int]] = {}  # id(param) -> (index in params, offset, numel)
        self.numel = 0
        self.flat: Optional[torch.Tensor] = None  # gathered working params while in use
        self.active = 0                           # modules running that use it
        self.n_trainable = 0
        self.grad: Optional[torch.Tensor] = None  # fp32 gradient of the current backward
        self.received = 0
        self.got: set[int] = set()                # indices of params whose gradient arrived
        self.bw_flat = None                       # weakref to the last backward gather

    def add(self, p: torch.nn.Parameter) -> None:
        n = p.numel()
        self.slot_of[id(p)] = (len(self.params), self.numel, n)
        self.params.append((p, self.numel, n))
        self.numel += n
        if p.requires_grad:
            self.n_trainable += 1


# Tensor calls that read no parameter values: a released parameter answers them without a gather.
def _metadata_calls() -> frozenset:
    T = torch.Tensor
    names = ["size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
             "stride", "storage_offset", "is_contiguous", "requires_grad_", "register_hook",
             "register_post_accumulate_grad_hook", "data_ptr", "untyped_storage", "_is_view",
             "get_device", "type", "__len__"]
    out = set()
    for n in names:
        f = getattr(T, n, None)
        if f is not None:
            out.add(f)
    return frozenset(out)


_METADATA = _metadata_calls()


def _is_metadata(func) -> bool:
    # Property accessors (shape, dtype, device, data, grad, requires_grad, _base, ...) read no values.
    return func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__")


def _gather_released(args, kwargs) -> list:
    """Gathers the units of released parameters among the call's arguments (top level and one
    level of lists/tuples); returns the (hooks, unit) pairs to release after the call."""
    taken = []

    def visit(a):
        h = getattr(a, "_tm_hooks", None) if isinstance(a, torch.nn.Parameter) else None
        if h is not None and h.engine is not None:
            hit = h.unit_of.get(id(a))
            if hit is not None and hit[0].flat is None:
                h.gather(hit[0])
                taken.append((h, hit[0]))

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
    taken = () if _is_metadata(func) else _gather_released(args, kwargs)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if taken and func is torch.Tensor.detach:
                out = out.clone()
            return out
    finally:
        for h, u in taken:
            if u.active == 0:
                h._release(u)


_SUBCLASSES: dict[tuple, type] = {}


def param_subclass(cls: type, prefix: str, torch_function) -> type:
    """`cls` (a Parameter class) with `torch_function` as its __torch_function__, made once per
    (class, prefix) and named <prefix><cls name>."""
    sub = _SUBCLASSES.get((cls, prefix))
    if sub is None:
        sub = type(f"{prefix}{cls.__name__}", (cls,), {"__torch_function__": classmethod(torch_function)})
        _SUBCLASSES[(cls, prefix)] = sub
    return sub


def _zero_param_class(cls: type) -> type:
    return param_subclass(cls, "Zero", _zero_param_torch_function)


class _Saved:
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: Unit, t: torch.Tensor) -> None:
        self.unit = unit
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


class ParamHooks:
    """Owns the units of one model and the hooks that drive the engine for it."""

    def __init__(self, model: torch.nn.Module, leaf_types: tuple = ()) -> None:
        self.model = model
        self.units: list[Unit] = []
        self.unit_of: dict[int, tuple[Unit, torch.nn.Parameter]] = {}  # id(param) -> (unit, param)
        self.module_units: dict[int, list[Unit]] = {}  # id(module) -> units it gathers
        self.engine = None
        self.working_dtype = torch.float32
        self.handles: list = []
        self.saved_ctx = None
        self.depth = 0
        self.backward_pending = False
        self.on_backward = None  # called once per backward that produced a gradient
        self.gathered_params_open = 0  # zero.GatheredParameters scopes now open
        self.dist_ops = None  # _dist.DistOps with several ranks
        # Several ranks: the units gathered so far in this forward / backward, and in the last
        # ones (what _prefetch_next predicts from).
        self.order: dict[str, list[int]] = {"forward": [], "backward": []}
        self.last_order: dict[str, Optional[list[int]]] = {"forward": None, "backward": None}
        # Where the model computes (its parameters' device; initialize checked they agree). The
        # engine's gathered memory is host memory: on another device (CUDA) each gathered unit is
        # copied in, and that copy is what the parameters view. copy_in forces the copy on the CPU
        # too (the CUDA path's CPU twin in the tests).
        first = next((p for p in model.parameters()), None)
        self.compute_device = first.device if first is not None else torch.device("cpu")
        self.copy_in = False
        self._build_units(leaf_types)

    def __reduce_ex__(self, protocol):
        raise TypeError("a model trained by a tiermem engine cannot be pickled or deep-copied whole: its parameters "
                        "live in the engine; save them with engine.save_fp32_model(path) (or model.state_dict()) "
                        "and checkpoints with engine.save_checkpoint(dir)")

    # ------------------------------------------------------------------------------ units
    def _build_units(self, leaf_types: tuple) -> None:
        seen: set[int] = set()
        skip: set[int] = set()  # modules inside a leaf: no hooks of their own
        for name, module in self.model.named_modules():
            if id(module) in skip:
                continue
            is_leaf = getattr(module, "_z3_leaf", False) or (leaf_types and isinstance(module, leaf_types))
            if is_leaf:
                for sub in module.modules():
                    if sub is not module:
                        skip.add(id(sub))
                params = [p for m in module.modules() for p in m._parameters.values() if p is not None]
            else:
                params = [p for p in module._parameters.values() if p is not None]
            unit = None   # this module's trainable parameters
            funit = None  # ... and its frozen ones
            needs: list[Unit] = []
            for p in params:
                if id(p) in seen:  # tied: gather the unit that owns it
                    owner = self.unit_of.get(id(p))
                    if owner is not None and owner[0] not in needs and owner[0] is not unit:
                        needs.append(owner[0])
                    continue
                seen.add(id(p))
                if not p.is_floating_point():
                    raise TypeError(f"tiermem.torch.initialize: parameter '{self._pname(module, p, name)}' is "
                                    f"{p.dtype}; ZeRO pages floating-point parameters only: register it as a buffer "
                                    "(module.register_buffer) instead")
                if p.requires_grad:
                    if unit is None:
                        unit = Unit(len(self.units), name or "<root>")
                        self.units.append(unit)
                        needs.insert(0, unit)
                    target = unit
                else:
                    if funit is None:
                        funit = Unit(len(self.units), (name or "<root>") + "[frozen]", frozen=True)
                        self.units.append(funit)
                        needs.insert(1 if unit is not None else 0, funit)
                    target = funit
                target.add(p)
                self.unit_of[id(p)] = (target, p)
            if needs:
                self.module_units[id(module)] = needs

    @staticmethod
    def _pname(module, p, prefix: str) -> str:
        for n, q in module.named_parameters():
            if q is p:
                return f"{prefix}.{n}" if prefix else n
        return prefix

    def numels(self) -> list[int]:
        return [u.numel for u in self.units]

    def frozen_flags(self) -> list[bool]:
        return [u.frozen for u in self.units]

    def trainable_params(self) -> list[torch.nn.Parameter]:
        return [p for u in self.units if not u.frozen for p, _, _ in u.params]

    def flat_values(self, unit: Unit) -> torch.Tensor:
        """The unit's current parameter values as one new fp32 vector (for registration): from
        zero.Init's staging for parameters built under it, else from the parameter itself."""
        from .zero import take_staged
        out = torch.empty(unit.numel, dtype=torch.float32)
        for p, off, n in unit.params:
            staged = take_staged(p)
            out[off:off + n].copy_((staged if staged is not None else p.detach()).reshape(-1))
        return out

    # ------------------------------------------------------------------------------ attach
    def attach(self, engine, working_dtype: torch.dtype) -> None:
        self.engine = engine
        self.working_dtype = working_dtype
        for u in self.units:
            self._release(u)
        for module in self.model.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        for u in self.units:
            for p, _, _ in u.params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                p._tm_original_class = type(p)
                p.__class__ = _zero_param_class(type(p))
                p._tm_hooks = self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for u in self.units:
            for p, _, _ in u.params:
                cls = p.__dict__.pop("_tm_original_class", None)
                if cls is not None:
                    p.__class__ = cls
                p.__dict__.pop("_tm_hooks", None)

    # ------------------------------------------------------------------------------ gather / release
    def _phase(self) -> str:
        if _in_backward():
            return "backward"
        if self.model.training:
            return "forward"
        return "outside"  # eval, generate(): outside the step's recorded trace

    def gather(self, unit: Unit, phase: Optional[str] = None, copy: bool = False) -> torch.Tensor:
        if unit.flat is None:
            flat = self._to_compute(self._engine_gather(unit, phase or self._phase()), copy)
            unit.flat = flat
            for p, off, n in unit.params:
                p.data = flat[off:off + n].view(p.shape)
        return unit.flat

    def _engine_gather(self, unit: Unit, phase: str) -> torch.Tensor:
        ops = self.dist_ops
        if ops is None:
            return self.engine.gather(unit.index, phase)
        ops.unit = unit.index  # the all-gather checks that every rank gathers this unit
        try:
            flat = self.engine.gather(unit.index, phase)
        finally:
            ops.unit = -1
        self._prefetch_next(unit, phase)
        return flat

    def _prefetch_next(self, unit: Unit, phase: str) -> None:
        """Several ranks: starts the all-gather of the unit the last pass gathered next, so that
        this unit's compute hides it (the engine's prefetch_gather). The order is what the last
        forward and backward recorded, position by position; where this pass departs from it
        (eval, another control flow) nothing is started until the next pass has recorded anew.
        Every rank records the same order, so every rank starts the same all-gathers."""
        if phase not in self.order:
            return
        cur = self.order[phase]
        cur.append(unit.index)
        last = self.last_order[phase]
        i = len(cur) - 1
        if last is None or i + 1 >= len(last) or last[i] != unit.index:
            return
        nxt = self.units[last[i + 1]]
        if nxt.flat is not None or (nxt.bw_flat is not None and nxt.bw_flat() is not None):
            return  # still gathered: its next use will not call the engine
        ops = self.dist_ops
        ops.unit = nxt.index
        try:
            self.engine.prefetch_gather(nxt.index, phase)
        finally:
            ops.unit = -1

    def end_pass(self) -> None:
        """The end of a backward: the order this forward and backward gathered in becomes the
        prediction for the next ones."""
        for phase, cur in self.order.items():
            if cur:
                self.last_order[phase] = cur
                self.order[phase] = []

    def _to_compute(self, flat: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """The gathered unit where the model computes: the engine's memory itself on the CPU, else
        a copy on the model's device (a blocking copy: the engine's scope ends when `flat` is
        dropped, so the host memory must not be read after this returns)."""
        if flat.device != self.compute_device or self.copy_in:
            return flat.to(self.compute_device, copy=True)
        return flat.clone() if copy else flat

    def _release(self, unit: Unit) -> None:
        unit.flat = None
        for p, _, _ in unit.params:
            p.data = _placeholder(p.shape, self.working_dtype, self.compute_device)

    def _saved_hooks_wanted(self) -> bool:
        """Pack parameters for backward unless another saved-tensor hook already owns this region:
        non-reentrant activation checkpointing's recompute keeps its own (detached) references to
        what it saves, which hold the gathered memory for as long as its backward needs it."""
        if not torch.is_grad_enabled():
            return False
        if _in_backward():
            return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        return True

    def _pre_forward(self, module, args):
        if self.depth == 0 and self._saved_hooks_wanted():
            self.saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saved_ctx.__enter__()
        self.depth += 1
        units = self.module_units.get(id(module))
        if units:
            done = []
            try:
                for u in units:
                    self.gather(u)
                    u.active += 1
                    done.append(u)
            except BaseException:  # the forward will not run, nor its post-forward hook
                for u in done:
                    u.active -= 1
                    if u.active == 0:
                        self._release(u)
                self._leave()
                raise

    def _post_forward(self, module, args, output):
        units = self.module_units.get(id(module))
        if units:
            for u in units:
                u.active -= 1
                if u.active == 0:
                    self._release(u)
        self._leave()
        return None

    def _leave(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.saved_ctx is not None:
            ctx, self.saved_ctx = self.saved_ctx, None
            ctx.__exit__(None, None, None)

    # ------------------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        hit = self.unit_of.get(id(t))
        if hit is None or hit[1] is not t:
            base = t._base
            if base is None:
                return t
            hit = self.unit_of.get(id(base))
            if hit is None or hit[1] is not base:
                return t
        return _Saved(hit[0], t)

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        u = s.unit
        flat = u.flat
        if flat is None:
            flat = u.bw_flat() if u.bw_flat is not None else None
            if flat is None:
                flat = self._to_compute(self._engine_gather(u, "backward"))
                u.bw_flat = weakref.ref(flat)
        return flat.as_strided(s.size, s.stride, s.offset)

    # ------------------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        unit, _ = self.unit_of[id(p)]
        g = p.grad
        p.grad = None
        if g is None:
            return
        self._queue_end_of_backward()
        if unit.grad is None and unit.n_trainable == 1 and g.numel() == unit.numel and \
                g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu":
            # A unit of one parameter (GPT-2's tied wte: 154 MB) reduces autograd's own gradient,
            # which nothing else holds now: no second buffer, no copy.
            unit.grad = g.detach().view(-1)
            unit.got = {0}
            unit.received = 1
            self._reduce(unit)
            return
        if unit.grad is None:
            # Not zeroed: each parameter's slice is written by its first gradient, and the slices
            # of parameters that got none are zeroed when the unit is reduced without them.
            unit.grad = torch.empty(unit.numel, dtype=torch.float32)
            unit.got = set()
        i, off, n = unit.slot_of[id(p)]
        dst = unit.grad[off:off + n]
        src = g.detach().reshape(-1)
        if i not in unit.got:
            dst.copy_(src)  # converts bf16/fp16 gradients to fp32 (and copies a CUDA one out) in one pass
            unit.got.add(i)
        else:
            dst.add_(src.to(device=dst.device, dtype=torch.float32))
        unit.received += 1
        if unit.received == unit.n_trainable:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        grad, unit.grad = unit.grad, None
        if len(unit.got) < len(unit.params):
            for i, (_, off, n) in enumerate(unit.params):
                if i not in unit.got:
                    grad[off:off + n].zero_()
        unit.received = 0
        unit.got = set()
        self.engine.reduce_gradients(unit.index, grad)

    def _queue_end_of_backward(self) -> None:
        if not self.backward_pending:
            self.backward_pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self.on_backward is not None:
                self.on_backward()

    def _end_of_backward(self) -> None:
        self.backward_pending = False
        self.end_pass()
        for u in self.units:
            if u.grad is not None:  # some of its parameters got no gradient: they add zero
                self._reduce(u)
            u.bw_flat = None

    # ------------------------------------------------------------------------------ helpers
    def release_all(self) -> None:
        for u in self.units:
            if u.active == 0:
                self._release(u)
