"""What a released engine parameter answers when code reaches its values without its module's
forward: reads get the engine's values, writes reach the engine, and what cannot be answered
raises an error naming the parameter. Never the placeholder's values (``_params.py``).

Between uses a managed parameter ``p`` holds a placeholder. Three ways reach its values:

- ``p`` itself in a torch call (``F.linear(x, p)``, ``p.clone()``, ``p.copy_(t)``): the parameter's
  class gathers its unit for the call (``_hooks.py``); a call that writes into ``p`` while it is
  released runs on a copy of the unit and the change is written to the engine
  (``write_through``): master weights and working copy, on every rank.
- ``p.data``, and views without autograd (``p.data[i]``, ``p[i]`` under ``no_grad``,
  ``p.data.t()``): a proxy (``ReleasedValues``) of the placeholder's shape tied to ``p`` and to the
  view calls that make it. A torch call given the proxy makes the view from the engine's values at
  that call (so it never reads stale values after a step), and writes it back when the call wrote
  into it (``ema.add_(p.data)`` reads, ``p.data.copy_(t)``, ``p.data[pad].zero_()``,
  ``nn.init.normal_(p.data)`` write). The same proxy design as zero.Init's stored views
  (``_init_store.py``), over the engine instead of the Init store file.
- The parameter's memory itself (``data_ptr()``, ``untyped_storage()``, what an extension kernel
  reads): a released parameter has none; the call raises, naming the parameter.

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from ._params import (apply_chain, contiguous_stride, is_data_get, is_data_set, is_inplace, is_metadata, is_view_call, placeholder,
                      raw_data, tensor_calls, view_on_meta)
from ._unit import unit_of

__all__ = ["ReleasedValues", "released_proxy", "write_through", "writes_released", "written_args", "gathering_many", "first_arg",
           "call_tensors", "is_released", "param_name", "no_memory_error", "unaliased", "wants_memory_of_its_own", "MEMORY_CALLS",
           "DETACH_CALLS"]

# Calls that hand out a tensor's memory, not its values: a released parameter has none.
MEMORY_CALLS = tensor_calls(["data_ptr", "untyped_storage", "storage", "_typed_storage"])
# The same values without autograd, sharing their memory: of a released parameter or its proxy, a
# proxy (a view of its values at each use, as torch's detach() shares the parameter's memory),
# unless the caller wants_memory_of_its_own.
DETACH_CALLS = tensor_calls(["detach"], (torch.Tensor, torch))


def wants_memory_of_its_own(frame) -> bool:
    """Whether the code of `frame`, which called detach() on a released parameter (or its proxy),
    hands the result to kernels or serializers that need memory, not a proxy: torch's own code (a
    module's ``_save_to_state_dict``, DDP's broadcast of the module's states, which writes into what
    it detached with no torch call a proxy could see), and any ``_save_to_state_dict`` (a module's
    override). It gets a copy of the values at the call."""
    name = frame.f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.") or frame.f_code.co_name == "_save_to_state_dict"


def is_released(p: torch.Tensor) -> bool:
    """Whether the managed parameter `p` holds its placeholder now (its unit is not gathered)."""
    unit = unit_of(p)
    return unit is not None and unit.flat is None


def param_name(p: torch.Tensor) -> str:
    """'<module path>.<key>' of a managed parameter (its first holder), for error messages."""
    unit = unit_of(p)
    i = unit.slot_of[id(p)][0]
    for j, mod, key in unit.holders:
        if j == i:
            prefix = unit.name[:-len("[frozen]")] if unit.name.endswith("[frozen]") else unit.name
            return f"{prefix}.{key}" if prefix != "<root>" else key
    return f"parameter {i} of {unit.name!r}"


def no_memory_error(p: torch.Tensor, func) -> RuntimeError:
    what = getattr(func, "__name__", "the call")
    return RuntimeError(f"tiermem.torch: {what}() of parameter '{param_name(p)}' {tuple(p.shape)}, which the tiermem "
                        "engine holds: between its module's forwards it has no memory here to hand out. Read its "
                        "values with a torch call (p.detach().clone(), p.data), or inside "
                        "`with tiermem.torch.zero.GatheredParameters([p]):`, where it has memory of its own")


def _owner(x) -> Optional[torch.nn.Parameter]:
    """The managed parameter a call argument stands for when it is released: itself, or the owner of
    a proxy (None for anything else, or a parameter whose unit is gathered now)."""
    if isinstance(x, ReleasedValues):
        p = x.__dict__.get("_tm_param")
        if unit_of(p) is None:
            raise RuntimeError("tiermem.torch: this tensor is the .data (or a view) of a parameter that a tiermem engine "
                               "held, which has been closed since; its values went with it")
        return p
    if isinstance(x, torch.nn.Parameter) and is_released(x):
        return x
    return None


def released_proxy(p: torch.nn.Parameter, chain: tuple = ()) -> "ReleasedValues":
    """The proxy of the released parameter `p` seen through `chain` ((func, args, kwargs) view
    calls, applied in order to its values)."""
    shape, dtype = p.shape, p.dtype
    if chain:
        levels = apply_chain(torch.empty(shape, dtype=dtype, device="meta"), chain)
        shape, dtype = levels[-1].shape, levels[-1].dtype
    proxy = placeholder(shape, dtype, raw_data(p).device).as_subclass(ReleasedValues)
    proxy._tm_param = p
    proxy._tm_chain = tuple(chain)
    return proxy


def view_proxy(x: torch.Tensor, p: torch.nn.Parameter, func, rest: tuple, kwargs: dict) -> Optional["ReleasedValues"]:
    """The proxy of ``func(x, *rest, **kwargs)`` for `x` standing for the released `p`, or None when
    torch gives a copy for this call (it then runs on the values, as torch would). Answered on a
    meta tensor: nothing is gathered."""
    for a in list(rest) + list(kwargs.values()):
        for y in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(y, torch.Tensor) and _owner(y) is not None:
                return None  # an index that is itself released: run on the values
    before = tuple(x.__dict__.get("_tm_chain", ())) if isinstance(x, ReleasedValues) else ()
    chain = before + ((func, tuple(rest), dict(kwargs)),)
    if view_on_meta(p.shape, contiguous_stride(p.shape), p.dtype, chain) is not None:
        return released_proxy(p, chain)
    # split, chunk, unbind: a tuple of views, each a proxy (they ran on the gathered values, and
    # writes into them changed the working copy alone, the master weights not).
    try:
        on_meta = apply_chain(torch.empty_strided(p.shape, contiguous_stride(p.shape), dtype=p.dtype, device="meta"),
                              before)[-1]
        with torch._C.DisableTorchFunctionSubclass():
            pieces = func(on_meta, *rest, **kwargs)
    except Exception:  # noqa: BLE001 - not answerable without values
        return None
    if not isinstance(pieces, (tuple, list)) or not pieces or \
            not all(isinstance(t, torch.Tensor) and t._is_view() for t in pieces):
        return None
    return tuple(released_proxy(p, before + ((_nth_of, (func, tuple(rest), dict(kwargs), i), {}),))
                 for i in range(len(pieces)))


def _nth_of(t: torch.Tensor, func, rest: tuple, kwargs: dict, i: int) -> torch.Tensor:
    """The i-th tensor of ``func(t, *rest, **kwargs)`` (a call that returns a tuple of views): one
    link of a proxy's chain."""
    return func(t, *rest, **kwargs)[i]


def call_tensors(args, kwargs):
    """Each tensor among a call's arguments (top level and one level of lists/tuples)."""
    for a in list(args) + list(kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, torch.Tensor):
                yield x


def first_arg(args, kwargs):
    """A call's first argument: positional, or by the name torch's functions give it (``nn.init``'s
    are called by keyword, ``tensor=``, through torch's function overrides)."""
    if args:
        return args[0]
    for key in ("tensor", "input", "self"):
        if key in kwargs:
            return kwargs[key]
    return None


@contextlib.contextmanager
def gathering_many(func, units: list):
    """Around one gather of a call that holds `units` gathered at once (torch._foreach_* over a
    model's parameters): the engine's out-of-memory error, when they do not fit its budgets
    together, is said as what the call did and how to do it instead (it said "a bug: please
    report", after the wait for a release that only the call itself could make)."""
    try:
        yield
    except MemoryError as e:
        if len(units) < 2:
            raise
        elem = torch.empty((), dtype=units[0].link.working_dtype).element_size()
        need = sum(u.numel for u in units) * elem
        raise MemoryError(f"tiermem.torch: {getattr(func, '__name__', 'a call')} on the parameters of {len(units)} engine "
                          f"modules holds them all gathered at once ({need} bytes), more than the engine's budgets hold "
                          "beside what they keep: call it on fewer parameters at a time (a loop over the model's "
                          "modules or parameters), or raise tiermem.device_budget_bytes / host_budget_bytes. The "
                          f"engine said: {e}") from e


def written_args(func, args, kwargs) -> list:
    """The call's arguments it writes into: its first for an in-place call (each tensor of it for a
    list, as ``torch._foreach_mul_(tensors, s)`` writes), and ``out=``."""
    out = []
    first = first_arg(args, kwargs)
    if is_inplace(func):
        out.extend(x for x in (first if isinstance(first, (list, tuple)) else (first,)) if isinstance(x, torch.Tensor))
    o = kwargs.get("out")
    for x in (o if isinstance(o, (list, tuple)) else (o,)):
        if isinstance(x, torch.Tensor):
            out.append(x)
    return out


def writes_released(written: list) -> bool:
    """Whether a call's `written` arguments (``written_args``) include a released managed
    parameter or a proxy of one: the call must run through write_through, which stores what it
    wrote in the engine."""
    return any(_owner(x) is not None for x in written)


def unaliased(out, units):
    """`out`, a call's result, with no memory of the `units` gathered for that call alone: a tensor
    (or numpy array) that shares a unit's gathered memory is copied, anything else returned as it
    is. The gathered memory would otherwise outlive the call in the caller's hands: the unit's
    memory pinned in the engine's budgets (a step then fails to write it) and the values stale
    after the next step, where torch's view would have shown the change. Autograd's views of a
    parameter (``p.t()`` with grad) are not given here."""
    spans = []
    for u in units:
        if u.flat is not None:
            st = u.flat.untyped_storage()
            spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    if not spans:
        return out
    if isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in out):
        return type(out)(unaliased(t, units) if isinstance(t, torch.Tensor) else t for t in out)
    if isinstance(out, torch.Tensor) and not out.requires_grad:
        with torch._C.DisableTorchFunctionSubclass():
            ptr = out.untyped_storage().data_ptr()
            if any(a <= ptr < b for a, b in spans):
                return out.clone()
        return out
    iface = getattr(out, "__array_interface__", None) if type(out).__module__ == "numpy" else None
    if iface is not None and any(a <= iface["data"][0] < b for a, b in spans):
        return out.copy()
    return out


def write_through(func, args, kwargs):
    """Runs a torch call whose arguments stand for released managed parameters (themselves or
    proxies) on the engine's values: each unit is gathered for the call (as a copy when the call
    writes into one of its parameters), each argument replaced by what it stands for, and the
    parameters written are stored in the engine after the call (``Unit.store``). A call that
    returns its written argument returns what the caller gave (the parameter or the proxy)."""
    owners = {}  # id(param) -> param
    for x in call_tensors(args, kwargs):
        p = _owner(x)
        if p is not None:
            owners.setdefault(id(p), p)
    written = {id(p): p for p in map(_owner, written_args(func, args, kwargs)) if p is not None}
    units = {}
    for p in owners.values():
        u = unit_of(p)
        units.setdefault(id(u), [u, False])
        if id(p) in written:
            units[id(u)][1] = True
    taken = []
    try:
        with gathering_many(func, [u for u, _ in units.values()]):
            for u, copy in units.values():
                if u.flat is None:
                    u.gather("outside", copy=copy)
                    taken.append(u)

        def stand_in(x):
            if isinstance(x, ReleasedValues):
                values = raw_data(x.__dict__["_tm_param"])
                return apply_chain(values, x.__dict__["_tm_chain"])[-1]
            return x

        def swap(a):
            if isinstance(a, list):
                return [stand_in(y) for y in a]
            if isinstance(a, tuple):
                return tuple(stand_in(y) for y in a)
            return stand_in(a)

        call_args = tuple(swap(a) for a in args)
        call_kwargs = {k: swap(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*call_args, **call_kwargs)
        if written:
            for u, copy in units.values():
                if copy:
                    u.store([p for p in written.values() if unit_of(p) is u])
        if args and out is call_args[0] and call_args[0] is not args[0]:
            return args[0]  # p.data.copy_(t) returns p.data: the proxy, not the copy it ran on
        if isinstance(out, torch.Tensor) and written and any(out is y for y in call_kwargs.values()):
            return next(v for k, v in kwargs.items() if call_kwargs[k] is out)
        return unaliased(out, [u for u, copy in units.values() if not copy and any(u is t for t in taken)])
    finally:
        for u in taken:
            if u.active == 0:
                u.release()


class ReleasedValues(torch.Tensor):
    """``p.data`` of a released managed parameter, or a view of it made without autograd: a
    placeholder of the view's shape tied to `p` (``_tm_param``) and the view calls (``_tm_chain``).
    Each torch call given it runs on the engine's values at that call (``write_through``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        x = first_arg(args, kwargs)
        if isinstance(x, ReleasedValues) and unit_of(x.__dict__.get("_tm_param")) is None:
            # Its engine was closed: what it is still answers (a debugger's view, a traceback's
            # locals), as the closed parameter's does; its values went with the engine.
            if func is torch.Tensor.__repr__:
                return (f"<tiermem.torch: tensor of shape {tuple(x.shape)}, {x.dtype}, a view of a parameter whose engine "
                        "was closed: no values>")
            if is_metadata(func) and func not in MEMORY_CALLS and not is_data_get(func):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        if isinstance(x, ReleasedValues) and (is_metadata(func) or func in MEMORY_CALLS):
            p = _owner(x)
            if func in MEMORY_CALLS:
                raise no_memory_error(p, func)
            if is_data_get(func):
                return released_proxy(p, x.__dict__["_tm_chain"])
            if is_data_set(func):
                raise RuntimeError(f"tiermem.torch: .data of parameter '{param_name(p)}' was given .data: give the "
                                   "parameter itself values instead (p.data = t, or p.data.copy_(t))")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if args and args[0] is x and isinstance(x, ReleasedValues) and func in DETACH_CALLS and \
                not wants_memory_of_its_own(sys._getframe(1)):
            return released_proxy(_owner(x), x.__dict__["_tm_chain"])
        if args and args[0] is x and isinstance(x, ReleasedValues) and is_view_call(func):
            proxy = view_proxy(x, _owner(x), func, args[1:], kwargs)
            if proxy is not None:
                return proxy
        return write_through(func, args, kwargs)
