"""Which engine unit a pass will gather next, from the order the last pass gathered them in.

With several ranks, gathering a unit is an all-gather; the units (``_unit.py``) ask this predictor,
after each gather from the engine, which unit comes next and start its all-gather then
(``ZeroEngine.prefetch_gather``), so that the current unit's compute hides it. Pure bookkeeping
over unit indices: no engine, no tensors.

Thread-safety: one thread drives a model (as torch's autograd does).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["NextUnitPredictor", "PHASES"]

PHASES = ("forward", "backward")  # the passes with a recorded order ("outside": eval, generate(), ...)


class NextUnitPredictor:
    """The order is what the last forward and backward recorded, position by position; where this
    pass departs from it (eval, another control flow) nothing is started until the next pass has
    recorded anew: a position predicts only where this pass gathered what the last one did (eval
    and generate() run outside the recorded phases). Every rank records the same order, so every
    rank starts the same all-gathers."""

    def __init__(self) -> None:
        # The units gathered so far in this forward / backward, and in the last ones.
        self.order: dict[str, list[int]] = {p: [] for p in PHASES}
        self.last_order: dict[str, Optional[list[int]]] = {p: None for p in PHASES}

    def record(self, phase: str, index: int) -> Optional[int]:
        """Notes that unit `index` was gathered from the engine in `phase`; returns the unit the
        last pass gathered after it at this position, or None (no recorded pass, a phase without
        an order, the end of the order, or this pass departs from it)."""
        cur = self.order.get(phase)
        if cur is None:
            return None
        cur.append(index)
        last = self.last_order[phase]
        i = len(cur) - 1
        if last is None or i + 1 >= len(last) or last[i] != index:
            return None
        return last[i + 1]

    def end_pass(self) -> None:
        """The end of a backward: the order this forward and backward gathered in becomes the
        prediction for the next ones (a phase that gathered nothing keeps its last order)."""
        for phase, cur in self.order.items():
            if cur:
                self.last_order[phase] = cur
                self.order[phase] = []
