"""DualPipe's F&B overlap priced for the simulator: one stream for compute, one for communication.

DeepSeek-V3 (arXiv 2412.19437, §3.2.1) runs the forward chunk of one microbatch and the backward
chunk of another together, so that the communication of each (the experts' all-to-all there and in
the runtime under ``--ep``; the context-parallel ring's exchanges) proceeds while the other
computes. With an action's time split into its compute c and the communication it waits for x
(exposed when it runs alone), an F&B pair lasts

    blocking:    (c_F + x_F) + (c_B + x_B)
    overlapped:  max(c_F + c_B, x_F + x_B)       (two streams, each serialised)

:class:`PairOverlapCost` wraps a cost model whose ``compute_time`` is the blocking time (c + x) and a
function giving x: the F of each pair marked in ``schedule.meta["overlapped_pairs"]`` then costs the
whole overlapped pair and its B nothing (the pair ends together), every other action keeps c + x. The
engine is unchanged: this is a cost model. It applies to whatever schedule marks pairs (DualPipeV's
F&B of two chunks; ``1f1b-overlap``'s steady-state F(k + w) and B(k) of one stage, Megatron-LM's
combined 1F1B): ``pipewright simulate`` wraps the cost model when the schedule's meta lists pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipewright.cost.base import CostModel
from pipewright.ir import Action, Schedule


def overlapped_pairs(schedule: Schedule) -> dict[Action, Action]:
    """F → B of every overlapped pair of ``schedule`` (compute-only or lowered), over all ranks."""
    marks = (schedule.meta or {}).get("overlapped_pairs") or ()
    out: dict[Action, Action] = {}
    for rank, positions in enumerate(marks):
        compute = [a for a in schedule.actions[rank] if schedule.kinds[a.kind].compute]
        for i in positions:
            if i + 1 < len(compute):
                out[compute[i]] = compute[i + 1]
    return out


def pair_time(c_f: float, x_f: float, c_b: float, x_b: float, overlap: bool) -> float:
    """One F&B pair's time (module docstring)."""
    if not overlap:
        return c_f + x_f + c_b + x_b
    return max(c_f + c_b, x_f + x_b)


@dataclass
class PairOverlapCost:
    """``base`` (blocking times) with the F&B pairs of the schedule overlapped when ``overlap``.

    ``exposed(action, schedule)``: the communication time inside ``base.compute_time`` of the action
    (0 for none). Other CostModel methods are ``base``'s."""

    base: CostModel
    exposed: Callable[[Action, Schedule], float]
    overlap: bool = True
    _pairs: dict[int, tuple[dict[Action, Action], set[Action]]] = field(default_factory=dict, repr=False)

    def _of(self, schedule: Schedule) -> tuple[dict[Action, Action], set[Action]]:
        key = id(schedule)
        if key not in self._pairs:
            pairs = overlapped_pairs(schedule)
            self._pairs[key] = (pairs, set(pairs.values()))
        return self._pairs[key]

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        if not self.overlap:
            return self.base.compute_time(action, schedule)
        pairs, second = self._of(schedule)
        if action in second:
            return 0.0
        if action in pairs:
            b = pairs[action]
            x_f, x_b = self.exposed(action, schedule), self.exposed(b, schedule)
            c_f = self.base.compute_time(action, schedule) - x_f
            c_b = self.base.compute_time(b, schedule) - x_b
            return pair_time(c_f, x_f, c_b, x_b, overlap=True)
        return self.base.compute_time(action, schedule)

    def __getattr__(self, name: str):
        return getattr(self.base, name)
