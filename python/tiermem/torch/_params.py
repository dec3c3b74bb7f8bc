"""Parameters between uses, and the parameter classes tiermem.torch gives them (shared by the
engine's units, ``_unit.py``, and zero.Init's store, ``_init_store.py``).

Between uses, a parameter's ``.data`` is a placeholder: a zero-stride expansion of one element, so
``param.shape`` stays true but the parameter holds no memory. The element is NaN (a poisoned
value, never a plausible one): every read tiermem knows of gathers the values or raises instead
(``_released.py``, ``_hooks.py``), and one it does not know of computes NaN, never zeros. (A
storage of zero bytes, FSDP2's choice, would fail louder, but with this torch a kernel given such a
tensor dereferences a null pointer: a crash, not an error.) Writing the placeholder fails.

A parameter whose memory is elsewhere (in the engine, or in Init's store) gets a class of its
own: a subclass of its class with a ``__torch_function__`` that brings the values in for a call
that reads them (``param_subclass``). Calls that read no values (``is_metadata``: sizes, strides,
hooks, property accessors) are answered by the placeholder.

Thread-safety: the caches here are filled from the thread that drives the model.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["placeholder", "holds_placeholder", "param_subclass", "is_metadata", "tensor_calls", "property_of",
           "VALUE_PROPERTIES", "is_data_get", "is_data_set", "is_view_call", "is_inplace", "raw_data", "set_raw_data",
           "apply_chain", "view_on_meta", "contiguous_stride"]

_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """A tensor of `shape` holding one NaN element of `dtype` on `device` (one per dtype and
    device, shared): what a parameter's ``.data`` is while its values are elsewhere."""
    key = (dtype, torch.device(device) if device is not None else torch.device("cpu"))
    base = _PLACEHOLDERS.get(key)
    if base is None:
        base = torch.full((), float("nan"), dtype=dtype, device=device)
        _PLACEHOLDERS[key] = base
    return base.expand(shape)


def holds_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` (read without __torch_function__) is a placeholder: its values are elsewhere."""
    return t.data_ptr() == placeholder((), t.dtype, t.device).data_ptr()


def raw_data(x: torch.Tensor) -> torch.Tensor:
    """``x.data`` without any __torch_function__ (what `x` holds now)."""
    with torch._C.DisableTorchFunctionSubclass():
        return x.data


def set_raw_data(x: torch.Tensor, t: torch.Tensor) -> None:
    """``x.data = t`` without any __torch_function__ (tiermem's own moves of a parameter's memory;
    a user's ``p.data = t`` goes through the parameter's class and is a write)."""
    with torch._C.DisableTorchFunctionSubclass():
        x.data = t


def tensor_calls(names, owners=(torch.Tensor,)) -> frozenset:
    """The functions of `owners` (torch.Tensor, the torch module, ...) named in `names`, those
    this torch has: the set a ``__torch_function__`` tests a call against."""
    return frozenset(f for owner in owners for n in names if (f := getattr(owner, n, None)) is not None)


def property_of(func, accessor: str = "__get__"):
    """The tensor property whose `accessor` (``__get__``, ``__set__``, ``__delete__``) the torch
    call `func` is (e.g. ``torch._C.TensorBase.data`` for ``p.data``), else None."""
    return getattr(func, "__self__", None) if getattr(func, "__name__", "") == accessor else None


# Tensor calls that read no parameter values: a released parameter answers them without a gather.
_METADATA = tensor_calls(["size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                          "stride", "storage_offset", "is_contiguous", "requires_grad_", "register_hook",
                          "register_post_accumulate_grad_hook", "data_ptr", "untyped_storage", "_is_view",
                          "get_device", "type", "__len__"])

# Properties that are views of the values (``p.T``, ``p.mT``, ``p.H``, ``p.mH``, ``p.real``,
# ``p.imag``): a call, not metadata. Answered by the placeholder they were zeros, silently (a head
# computed as ``x @ emb.weight.T`` outside the embedding's forward gave zero logits).
VALUE_PROPERTIES = tuple(getattr(torch._C.TensorBase, n) for n in ("T", "mT", "H", "mH", "real", "imag")
                         if hasattr(torch._C.TensorBase, n))


def is_metadata(func) -> bool:
    """Whether the torch call `func` reads no parameter values (it needs no gather)."""
    if func in _METADATA:
        return True
    # Property accessors (shape, dtype, device, data, grad, requires_grad, _base, ...) read no values;
    # those that are views of the values do.
    for accessor in ("__get__", "__set__", "__delete__"):
        prop = property_of(func, accessor)
        if prop is not None:
            return prop not in VALUE_PROPERTIES
    return False


def is_data_get(func) -> bool:
    """Whether the torch call `func` is the ``.data`` getter."""
    return property_of(func, "__get__") is torch._C.TensorBase.data


def is_data_set(func) -> bool:
    """Whether the torch call `func` is the ``.data`` setter."""
    return property_of(func, "__set__") is torch._C.TensorBase.data


# The calls that may return a view of their first argument (a copy for some arguments: a caller
# asks torch which, on a meta tensor).
_VIEW_CALLS = tensor_calls(("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "select", "narrow", "t",
                            "transpose", "swapaxes", "swapdims", "permute", "movedim", "unsqueeze", "squeeze",
                            "diagonal", "expand", "expand_as", "unbind", "split", "chunk"),
                           (torch.Tensor, torch)) | {torch._C.TensorBase.__getitem__}


def is_view_call(func) -> bool:
    """Whether the torch call `func` may return a view of its first argument (_VIEW_CALLS, and the
    properties that are views: ``.T``, ``.mT``, ... ``VALUE_PROPERTIES``)."""
    try:
        if func in _VIEW_CALLS:
            return True
    except TypeError:  # an unhashable callable: not one of them
        return False
    return property_of(func, "__get__") in VALUE_PROPERTIES


# In-place operators whose names do not end in one underscore.
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and",
                                                       "or", "xor", "lshift", "rshift", "matmul")) | {"__setitem__"}


def is_inplace(func) -> bool:
    """Whether the torch call `func` writes into its first argument (torch's naming: ``add_``,
    ``copy_``, ``nn.init.normal_``, ``__iadd__``, ``__setitem__``); writes through ``out=`` are
    the caller's to check."""
    name = getattr(func, "__name__", "") or ""
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and func not in _METADATA


def contiguous_stride(shape) -> tuple:
    """The strides (elements) of a contiguous tensor of `shape`."""
    stride, step = [], 1
    for n in reversed(tuple(shape)):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def apply_chain(t: torch.Tensor, chain) -> list:
    """[t, chain[0] of t, chain[1] of that, ...]: the tensors a view proxy's chain of (func, args,
    kwargs) view calls makes from `t` (``_init_store.py``'s and ``_released.py``'s proxies)."""
    levels = [t]
    with torch._C.DisableTorchFunctionSubclass():
        for func, rest, kw in chain:
            levels.append(func(levels[-1], *rest, **kw))
    return levels


def view_on_meta(shape, stride, dtype: torch.dtype, chain) -> Optional[torch.Tensor]:
    """What `chain` makes of a tensor of `shape`, `stride` and `dtype`, run on a meta tensor (no
    values), when every call of it gives a view; None when one gives a copy (or needs values)."""
    try:
        levels = apply_chain(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), chain)
    except Exception:  # noqa: BLE001 - not answerable without values (a mask index)
        return None
    out = levels[-1]
    if not isinstance(out, torch.Tensor) or not all(t._is_view() for t in levels[1:]):
        return None
    return out


_SUBCLASSES: dict[tuple, type] = {}


def param_subclass(cls: type, prefix: str, torch_function) -> type:
    """`cls` (a Parameter class) with `torch_function` as its __torch_function__, made once per
    (class, prefix) and named <prefix><cls name>."""
    sub = _SUBCLASSES.get((cls, prefix))
    if sub is None:
        sub = type(f"{prefix}{cls.__name__}", (cls,), {"__torch_function__": classmethod(torch_function)})
        _SUBCLASSES[(cls, prefix)] = sub
    return sub
