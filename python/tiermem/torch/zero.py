"""``tiermem.torch.zero``: DeepSpeed's ``deepspeed.zero`` context managers over tiermem's engine.

``GatheredParameters(params, modifier_rank=None)``: inside, the full parameters are in ``.data``
(gathered from their tier); on exit, parameters whose values changed are written back to the
engine (``ZeroEngine::set_module_params``: fp32 master weights replaced, working copy republished,
Adam moments kept) and released. With one rank ``modifier_rank`` makes no difference.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

__all__ = ["GatheredParameters"]


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
                continue  # not managed (frozen, or no engine): already whole
            unit, _ = h.unit_of[id(p)]
            by_unit.setdefault((id(h), unit.index), (h, unit))
        for h, unit in by_unit.values():
            h.gather(unit, "outside")
            unit.active += 1
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
                values = torch.empty(unit.numel, dtype=torch.float32)
                for q, off, n in unit.params:
                    values[off:off + n].copy_(q.data.reshape(-1))
                writes.append((h, unit, values))
        for h, unit, _ in held:  # the gathered copy goes first: the write-back replaces it
            unit.active -= 1
            if unit.active == 0:
                h._release(unit)
        for h, unit, values in writes:
            h.engine.set_module_params(unit.index, values)
        return False
