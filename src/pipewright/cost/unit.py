"""``--cost unit``: every action on one chunk costs F = 1, B = 2, I = W = 1 (scaled by 1/v for a rank's
v chunks when ``per_chunk`` is set), communication is free, and extension compute kinds cost 1."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipewright.ir import Action, B, F, I, Schedule, W

_UNIT = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


@dataclass(frozen=True)
class UnitCost:
    """Unit costs. ``times`` overrides per kind (e.g. ``{"F": 1, "I": 1, "W": 1, "B": 2}``);
    ``per_chunk=True`` divides compute by the chunks per rank v (interleaved chunks are 1/v of a
    rank's layers); ``activation`` is the memory one chunk-microbatch holds (1 unit by default)."""

    times: Mapping[str, float] = field(default_factory=lambda: dict(_UNIT))
    per_chunk: bool = False
    activation: float = 1.0

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        spec = schedule.kinds[action.kind]
        if not spec.compute:
            return 0.0
        t = self.times.get(action.kind, 1.0)
        return t / schedule.chunks_per_rank if self.per_chunk else t

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        return 0.0

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        return schedule.kinds[action.kind].memory * self.activation

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return 0.0

    def flops(self, action: Action, schedule: Schedule) -> float:
        return self.compute_time(action, schedule)

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        return self.compute_time(action, schedule)


@dataclass(frozen=True)
class StageTimes(UnitCost):
    """Per-stage compute times: ``f[s]``, ``i[s]``, ``w[s]`` for F, I, W on stage s (B = I + W), the
    simulator's view of the per-stage costs a cost-aware schedule is built from
    (:class:`~pipewright.schedules.registry.ScheduleCosts`); other kinds cost nothing."""

    f: tuple[float, ...] = ()
    i: tuple[float, ...] = ()
    w: tuple[float, ...] = ()

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        s = action.stage
        kind = action.kind
        if kind == B:
            return self.i[s] + self.w[s]
        table = {F: self.f, I: self.i, W: self.w}.get(kind)
        return 0.0 if table is None else table[s]
