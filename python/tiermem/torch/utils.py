"""DeepSpeed's ZeRO-3 utility functions (``deepspeed.utils``) for parameters a tiermem engine holds,
with DeepSpeed's signatures, so TRL, Hugging Face and user code written for them run unchanged.

Each takes a ``torch.nn.Parameter`` of a model passed to ``tiermem.torch.initialize`` and works on
its engine unit: a full (unpartitioned) fp32 tensor of the parameter's shape comes back as a new
tensor the caller owns; a setter takes a tensor of the parameter's shape (any float dtype, any
device) and writes it through the engine to every rank's shard. With several ranks each call is
a collective: call it on every rank, for the same parameters in the same order. Call between
steps (not inside a forward), outside ``zero.GatheredParameters``.

- ``safe_get_full_fp32_param(param)``: the fp32 master weights (a frozen parameter: its working
  values as fp32, since it has no master).
- ``safe_set_full_fp32_param(param, value)``: replaces them (and the working copy).
- ``safe_get_full_optimizer_state(param, optim_state_key)``: ``"exp_avg"`` or ``"exp_avg_sq"``
  (AdamW's moments); None for a frozen parameter (it has no optimizer state).
- ``safe_set_full_optimizer_state(param, value, optim_state_key)``.
- ``safe_get_full_grad(param)``: the gradient the next optimizer step will use (the mean over
  ranks, unscaled, summed over the micro-batches of the step), valid between ``backward`` and
  ``step``; None for a frozen parameter. Outside that window: RuntimeError.

Errors: TypeError for a parameter no tiermem engine manages (a tensor of another model, or after
``engine.close()``); ValueError for a wrong shape, an unknown ``optim_state_key`` or setting
state a frozen parameter does not have.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._unit import unit_of

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad"]


def _slot(param, call: str):
    """(C++ engine, unit, offset, numel) of a managed parameter, or TypeError."""
    unit = unit_of(param)
    if unit is None or unit.engine is None:
        raise TypeError(f"tiermem.torch.utils.{call}: the parameter is not managed by a tiermem engine (pass a "
                        "parameter of a model given to tiermem.torch.initialize, before engine.close())")
    _, off, n = unit.slot_of[id(param)]
    return unit.engine, unit, off, n


def _values(value, param, call: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tiermem.torch.utils.{call}: value must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"tiermem.torch.utils.{call}: value has shape {tuple(value.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    return value.detach().to(device="cpu", dtype=torch.float32).reshape(-1)


def safe_get_full_fp32_param(param) -> torch.Tensor:
    zero, unit, off, n = _slot(param, "safe_get_full_fp32_param")
    return zero.export_master(unit.index)[off:off + n].clone().view(param.shape)


def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    zero, unit, off, n = _slot(param, "safe_set_full_fp32_param")
    v = _values(value, param, "safe_set_full_fp32_param")
    full = zero.export_master(unit.index)
    full[off:off + n] = v
    zero.set_module_params(unit.index, full)


def _state_key(key: str, call: str) -> str:
    if key not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"tiermem.torch.utils.{call}: optim_state_key {key!r} is not one of 'exp_avg', "
                         "'exp_avg_sq' (the engine's AdamW keeps those two)")
    return key


def safe_get_full_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    zero, unit, off, n = _slot(param, "safe_get_full_optimizer_state")
    key = _state_key(optim_state_key, "safe_get_full_optimizer_state")
    if unit.frozen:
        return None
    return zero.export_module_state(unit.index, key)[off:off + n].clone().view(param.shape)


def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    zero, unit, off, n = _slot(param, "safe_set_full_optimizer_state")
    key = _state_key(optim_state_key, "safe_set_full_optimizer_state")
    if unit.frozen:
        raise ValueError("tiermem.torch.utils.safe_set_full_optimizer_state: the parameter is frozen "
                         "(requires_grad=False at initialize): it has no optimizer state")
    v = _values(value, param, "safe_set_full_optimizer_state")
    full = zero.export_module_state(unit.index, key)
    full[off:off + n] = v
    zero.set_module_state(unit.index, key, full)


def safe_get_full_grad(param) -> Optional[torch.Tensor]:
    zero, unit, off, n = _slot(param, "safe_get_full_grad")
    if unit.frozen:
        return None
    engine = getattr(unit.link.model, "_tiermem_engine", None)
    if engine is None or not engine.gradients_ready():
        raise RuntimeError("tiermem.torch.utils.safe_get_full_grad: no gradient now: it is valid between "
                           "engine.backward(loss) (or loss.backward()) and the optimizer step that consumes it")
    return zero.export_grad(unit.index)[off:off + n].clone().view(param.shape)
