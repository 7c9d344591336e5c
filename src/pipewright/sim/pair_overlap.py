"""DualPipe's F&B overlap priced for the simulator: one stream for compute, one for communication.

DeepSeek-V3 (arXiv 2412.19437, §3.2.1) runs the forward chunk of one microbatch and the backward
chunk of another together, so that the communication of each (the experts' all-to-all there and in
the runtime under ``--ep``; in the runtime also the context-parallel ring's exchanges, which no cost
model exposes here yet) proceeds while the other computes. With an action's time split into its
compute c and the communication it waits for x (exposed when it runs alone), an F&B pair lasts

    blocking:    (c_F + x_F) + (c_B + x_B)
    overlapped:  max(c_F + c_B, x_F + x_B)       (two streams, each serialised)

:class:`PairOverlapCost` wraps a cost model whose ``compute_time`` is the blocking time (c + x) and a
function giving x: the F of each pair marked in ``schedule.meta["overlapped_pairs"]`` then costs the
whole overlapped pair and its B nothing (the pair ends together), every other action keeps c + x (and
so does a pair with no communication, x_F + x_B = 0: nothing to overlap, as the runtime runs it). The
engine is unchanged: this is a cost model. It applies to whatever schedule marks pairs (DualPipeV's
F&B of two chunks; ``1f1b-overlap``'s steady-state F(k + w) and B(k) of one stage, Megatron-LM's
combined 1F1B): ``pipewright simulate`` and the planner's simulation of a plan wrap the cost model
(:func:`with_pair_overlap`) when the schedule's meta lists pairs. Its times vary per action, which it
declares (``varies_per_action``), so the simulator asks it of every compute action.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipewright.cost.base import CostModel
from pipewright.ir import Action, Schedule
from pipewright.sim.array_coding import varies_per_action


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
    (0 for none). Other CostModel methods are ``base``'s.

    Its compute times differ between microbatches of one (kind, stage): an F that opens a pair costs
    the whole pair, the B that closes it nothing, an unpaired F or B its blocking time; a pair with no
    communication to hide (x_F + x_B = 0, e.g. ep = 1) runs as two blocking actions, as the runtime
    runs it. It says so
    (:attr:`varies_per_action`), and the simulator then asks :meth:`compute_time` of every compute
    action instead of once per (kind, stage) (:func:`pipewright.sim.array_coding.varies_per_action`).
    ``base``'s own times are asked once per (kind, stage, payload), as the simulator asks an ordinary
    cost model."""

    base: CostModel
    exposed: Callable[[Action, Schedule], float]
    overlap: bool = True
    _pairs: tuple[Schedule, dict[Action, Action], dict[Action, Action]] | None = field(
        default=None, init=False, repr=False, compare=False
    )  # (caches, fresh in each copy: dataclasses.replace gives a new one)
    _times: dict[tuple, tuple[float, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def varies_per_action(self) -> bool:
        """True when pairs are overlapped (a paired action's time is not its kind and stage's)."""
        return self.overlap

    def _of(self, schedule: Schedule) -> tuple[dict[Action, Action], dict[Action, Action]]:
        """The pairs of ``schedule``, F → B and B → F; kept for the last schedule asked about."""
        if self._pairs is None or self._pairs[0] is not schedule:
            pairs = overlapped_pairs(schedule)
            self._pairs = (schedule, pairs, {b: f for f, b in pairs.items()})
        return self._pairs[1], self._pairs[2]

    def _alone(self, action: Action, schedule: Schedule) -> tuple[float, float]:
        """(blocking time c + x, exposed communication x) of ``action``, once per (kind, stage, payload)."""
        key = (action.kind, action.stage, action.payload)
        if varies_per_action(self.base):
            key += (action.microbatch,)
        out = self._times.get(key)
        if out is None:
            out = (float(self.base.compute_time(action, schedule)), float(self.exposed(action, schedule)))
            self._times[key] = out
        return out

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        if not self.overlap:
            return self.base.compute_time(action, schedule)
        pairs, second = self._of(schedule)
        t, x = self._alone(action, schedule)
        f = second.get(action)
        if f is not None:  # the B that closes a pair: 0, unless the pair has nothing to overlap
            return t if x + self._alone(f, schedule)[1] == 0.0 else 0.0
        b = pairs.get(action)
        if b is None:
            return t
        t_b, x_b = self._alone(b, schedule)
        return t if x + x_b == 0.0 else pair_time(t - x, x, t_b - x_b, x_b, overlap=True)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("base", "_pairs", "_times"):
            raise AttributeError(name)  # (copy and pickle look these up before __init__ ran)
        return getattr(self.base, name)


def with_pair_overlap(cost: CostModel, schedule: Schedule) -> CostModel:
    """``cost`` wrapped in :class:`PairOverlapCost` when ``schedule`` marks F&B pairs and ``cost``
    exposes its communication (``exposed_comm``: the MoE all-to-alls; no dense cost model has one yet); else
    ``cost``. ``pipewright simulate`` and the planner's simulation of a plan wrap the same way."""
    if hasattr(cost, "exposed_comm") and (schedule.meta or {}).get("overlapped_pairs"):
        return PairOverlapCost(cost, cost.exposed_comm)
    return cost
