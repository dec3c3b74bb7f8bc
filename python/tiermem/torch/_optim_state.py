"""``ZeroOptimizer.state_dict()`` / ``load_state_dict()``: the engine's whole optimizer state in
torch's layout, so that code saving and restoring a torch optimizer (the HF Trainer's
``optimizer.pt`` and its ``resume_from_checkpoint``) resumes a tiermem run bit for bit.

The dict is torch's: ``{"state": {i: {...}}, "param_groups": [...]}`` with ``i`` the index of the
i-th trainable parameter over the param groups (the optimizer's order), plus one ``"tiermem"``
entry (optimizer type, skipped steps, fp16 loss-scaler state). Each parameter's entry holds full
fp32 tensors of the parameter's shape, as a torch optimizer keeps them:

- ``"master"``: the fp32 master weights (what the next step updates);
- the optimizer's own state under torch's names: AdamW ``"exp_avg"``, ``"exp_avg_sq"``; Lion
  ``"exp_avg"``; Adagrad ``"sum"``;
- ``"step"``: the engine's optimizer step count (Adam's bias correction, Adagrad's lr decay), a
  0-d float32 tensor as torch's optimizers store it.

Memory: ``state_dict()`` materialises the full fp32 state of every trainable parameter in host
memory (12 bytes per parameter with AdamW), reading the engine one unit at a time into the dict:
a model's whole optimizer state at once, where ``engine.save_checkpoint`` streams it one
sub-group at a time. ``load_state_dict()`` writes it back one unit at a time (master weights and
the working copy, the moments), then the step count and loss-scaler state with one pass of the
engine's state import (which holds this rank's shard of the state, 12 bytes per element, in
host memory for the pass; skipped when they already match).

With several ranks each call is a collective (the engine all-gathers each unit): every rank
calls, with the same dict on load.

Errors (``load_state_dict``): ValueError naming the parameter (index and name) and the key for a
missing or unknown entry, a wrong shape or a non-tensor value; for param groups that differ; for
another optimizer type's state. Nothing is written before the whole dict is checked. A dict with
the hyper-parameters only (``"state"`` empty: what ``state_dict()`` returned before it held the
state) restores them and warns that the master weights, moments and step count were not restored.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict"]

# torch's name for each optimizer state the engine keeps -> the engine's key (its slots: AdamW's
# exp_avg and exp_avg_sq; Lion's exp_avg in slot 1; Adagrad's sum in slot 2, DeepSpeed's exp_avg_sq).
_MOMENTS = {
    "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "lion": {"exp_avg": "exp_avg"},
    "adagrad": {"sum": "exp_avg_sq"},
}
_ALL_STATE_KEYS = {"master", "step"} | {k for m in _MOMENTS.values() for k in m}


def optimizer_family(kind: str) -> str:
    """The kind of state an optimizer type keeps ("adamw", "lion", "adagrad"): Adam is AdamW's."""
    k = str(kind).lower()
    return "adamw" if k == "adam" else k


def _moments(engine) -> dict:
    family = optimizer_family(engine.config["optimizer"]["type"])
    if family not in _MOMENTS:  # the engine refuses other types at initialize; said plainly anyway
        raise NotImplementedError(f"ZeroOptimizer.state_dict: optimizer type {family!r} has no state layout here "
                                  f"(AdamW, Lion, Adagrad)")
    return _MOMENTS[family]


def _groups(optimizer) -> list:
    """param_groups without the tensors, "params" as torch numbers them (0.. over the groups)."""
    out, start = [], 0
    for g in optimizer.param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(d)
    return out


def _param_index(optimizer) -> dict:
    """id(param) -> its index in the optimizer's order."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _param_names(engine) -> dict:
    return {id(p): n for n, p in engine.module.named_parameters(remove_duplicate=True)}


def _trainable_slots(engine, optimizer):
    """(unit, [(index, param, offset, numel)]) for every unit that trains, in engine order."""
    index = _param_index(optimizer)
    for u in engine.units:
        if u.frozen:
            continue
        yield u, [(index[id(p)], p, off, n) for p, off, n in u.params]


def optimizer_state_dict(engine, optimizer) -> dict:
    """The state dict described above (a collective with several ranks)."""
    engine.check_open()
    moments = _moments(engine)
    zero = engine._zero
    st = zero.stats()
    step = torch.tensor(float(st["steps"]), dtype=torch.float32)
    state: dict[int, dict] = {}
    for u, slots in _trainable_slots(engine, optimizer):
        for i, p, _, _ in slots:
            state[i] = {"step": step.clone()}
        for key, engine_key in [("master", None)] + list(moments.items()):
            full = engine.master_weights(u.index) if engine_key is None else \
                zero.export_module_state(u.index, engine_key)
            for i, p, off, n in slots:
                state[i][key] = full[off:off + n].clone().view(p.shape)
            del full
    header = {"optimizer_type": optimizer_family(engine.config["optimizer"]["type"]),
              "steps": int(st["steps"]), "skipped_steps": int(st["skipped_steps"])}
    scaler = _loss_scaler(engine)
    if scaler is not None:
        header["loss_scaler"] = scaler
    return {"state": dict(sorted(state.items())), "param_groups": _groups(optimizer), "tiermem": header}


_SCALER_KEYS = ("loss_scale", "loss_scale_hysteresis_left", "loss_scale_iter", "loss_scale_last_overflow_iter")


def _loss_scaler(engine) -> Optional[dict]:
    """The fp16 loss scaler's state (None without fp16). Only the engine's state header carries it:
    read through the streamed export with a sink that keeps nothing."""
    if not engine.fp16:
        return None
    header = engine.export_optimizer_state(lambda *chunk: None)
    return {k: header[k] for k in _SCALER_KEYS}


def load_optimizer_state_dict(engine, optimizer, state_dict) -> None:
    """Restores a state dict of optimizer_state_dict (see the module's docstring)."""
    engine.check_open()
    if not isinstance(state_dict, dict):
        raise ValueError(f"ZeroOptimizer.load_state_dict: expected a dict, got {type(state_dict).__name__}")
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        n = len(groups) if isinstance(groups, (list, tuple)) else groups
        raise ValueError(f"ZeroOptimizer.load_state_dict: 'param_groups' has {n} groups, this optimizer "
                         f"{len(optimizer.param_groups)}")
    for gi, (g, saved) in enumerate(zip(optimizer.param_groups, groups)):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(g["params"]):
            have = len(saved.get("params", ())) if isinstance(saved, dict) else saved
            raise ValueError(f"ZeroOptimizer.load_state_dict: param group {gi} has {have} parameters in the state dict, "
                             f"{len(g['params'])} in this optimizer: not the same model's optimizer")
    state = state_dict.get("state") or {}
    if not isinstance(state, dict):
        raise ValueError(f"ZeroOptimizer.load_state_dict: 'state' must be a dict, got {type(state).__name__}")
    header = state_dict.get("tiermem") if isinstance(state_dict.get("tiermem"), dict) else {}
    plan = _check_state(engine, optimizer, state, header) if state else None

    def set_hparams():
        for g, saved in zip(optimizer.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v

    if plan is None:
        set_hparams()
        warnings.warn("ZeroOptimizer.load_state_dict: the state dict holds the hyper-parameters only (no 'state': "
                      "one saved before tiermem's state_dict carried the state); the fp32 master weights, moments "
                      "and step count were NOT restored, so training does not continue as the saved run would",
                      stacklevel=3)
        return
    steps, skipped, scaler = plan
    zero = engine._zero
    moments = _moments(engine)
    for u, slots in _trainable_slots(engine, optimizer):
        for key, engine_key in [("master", None)] + list(moments.items()):
            full = torch.empty(u.numel, dtype=torch.float32)
            for i, p, off, n in slots:
                full[off:off + n] = state[i][key].detach().to(device="cpu", dtype=torch.float32).reshape(-1)
            if engine_key is None:
                zero.set_module_params(u.index, full)  # the master, and the working copy republished
            else:
                zero.set_module_state(u.index, engine_key, full)
            del full
    _set_counts(engine, steps, skipped, scaler)
    engine.global_steps = steps
    engine.skipped_steps = skipped
    set_hparams()


def _check_state(engine, optimizer, state: dict, header: dict):
    """Validates every entry before anything is written; returns (steps, skipped_steps, scaler)."""
    moments = _moments(engine)
    family = optimizer_family(engine.config["optimizer"]["type"])
    saved_type = header.get("optimizer_type")
    if isinstance(saved_type, str) and optimizer_family(saved_type) != family:
        raise ValueError(f"ZeroOptimizer.load_state_dict: the state dict holds {saved_type}'s state, this engine's "
                         f"optimizer is {engine.config['optimizer']['type']}: the state does not carry over")
    names = _param_names(engine)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    want = ["master", "step"] + list(moments)

    def where(i) -> str:
        return f"parameter {i} ({names.get(id(params[i]), '?')})" if 0 <= i < len(params) else f"parameter {i}"

    for k in state:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(params):
            raise ValueError(f"ZeroOptimizer.load_state_dict: 'state' has an entry for parameter {k!r}; this "
                             f"optimizer has parameters 0..{len(params) - 1}")
    steps = None
    for i, p in enumerate(params):
        entry = state.get(i)
        if entry is None:
            raise ValueError(f"ZeroOptimizer.load_state_dict: 'state' has no entry for {where(i)}")
        if not isinstance(entry, dict):
            raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)}: its state is a {type(entry).__name__}, "
                             "not a dict")
        for key in want:
            if key not in entry:
                other = sorted(set(entry) & (_ALL_STATE_KEYS - set(want)))
                hint = (f" (it has {', '.join(map(repr, other))}: another optimizer type's state; this engine's "
                        f"{engine.config['optimizer']['type']} keeps {', '.join(map(repr, want))})" if other else
                        " (state dicts of tiermem's ZeroOptimizer hold 'master', 'step' and the optimizer's moments)")
                raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} has no {key!r}{hint}")
        for key in entry:
            if key not in want:
                raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} has key {key!r}, which this engine's "
                                 f"{engine.config['optimizer']['type']} does not keep ({', '.join(map(repr, want))})")
        for key in want:
            v = entry[key]
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() and key != "step":
                raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} {key!r} is "
                                 f"{type(v).__name__ if not isinstance(v, torch.Tensor) else v.dtype}, not a "
                                 "floating-point tensor")
            if key != "step" and tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} {key!r} has shape {tuple(v.shape)}, "
                                 f"the parameter {tuple(p.shape)}")
        s = entry["step"]
        if s.numel() != 1 or not math.isfinite(float(s)) or float(s) < 0 or float(s) != int(float(s)):
            raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} 'step' = {s.tolist()} is not a step count "
                             "(an integer >= 0)")
        if steps is None:
            steps = int(float(s))
        elif int(float(s)) != steps:
            raise ValueError(f"ZeroOptimizer.load_state_dict: {where(i)} 'step' = {int(float(s))} but parameter 0's "
                             f"is {steps}: the engine steps every parameter together")
    skipped = header.get("skipped_steps", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(f"ZeroOptimizer.load_state_dict: 'tiermem' 'skipped_steps' = {skipped!r} must be an "
                         "integer >= 0")
    scaler = header.get("loss_scaler")
    if engine.fp16 and scaler is not None and (not isinstance(scaler, dict) or set(scaler) != set(_SCALER_KEYS)):
        raise ValueError(f"ZeroOptimizer.load_state_dict: 'tiermem' 'loss_scaler' must be a dict of "
                         f"{', '.join(_SCALER_KEYS)}, got {scaler!r}")
    return steps, skipped, scaler if engine.fp16 else None


def _set_counts(engine, steps: int, skipped: int, scaler: Optional[dict]) -> None:
    """Sets the engine's step counts (and fp16 loss-scaler state). The engine takes them only with
    a whole state import: its state is exported into host memory and imported back unchanged with
    the new header, one pass each way. Skipped when nothing differs."""
    st = engine._zero.stats()
    if int(st["steps"]) == steps and int(st["skipped_steps"]) == skipped and scaler is None:
        return
    chunks: list = []  # (offset, master, exp_avg, exp_avg_sq): numpy copies of one sub-group each

    def keep(offset, master, exp_avg, exp_avg_sq):  # the spans are valid during the call only
        chunks.append((offset, master.copy(), exp_avg.copy(), exp_avg_sq.copy()))

    header = engine.export_optimizer_state(keep)
    header = dict(header, steps=steps, skipped_steps=skipped)
    if scaler is not None:
        header.update(scaler)
    it = iter(chunks)

    def give(offset, master, exp_avg, exp_avg_sq):
        off, m, a, b = next(it)
        if off != offset or len(m) != len(master):
            raise RuntimeError(f"ZeroOptimizer.load_state_dict: the engine's state import asked for elements at "
                               f"{offset} ({len(master)}), its export gave {off} ({len(m)})")
        master[...] = m
        exp_avg[...] = a
        exp_avg_sq[...] = b

    engine.import_optimizer_state(header, give)
