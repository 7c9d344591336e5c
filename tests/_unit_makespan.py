"""Test helpers: unit-cost makespans through the real simulator (``pipewright.sim.simulate``).

Costs per chunk action: F = I = W = 1, B = 2 unless overridden; communication is free.
"""

from __future__ import annotations

from pipewright.cost import UnitCost
from pipewright.cost.base import ConstantComm
from pipewright.ir import Schedule
from pipewright.sim import simulate

UNIT = {"F": 1, "I": 1, "W": 1, "B": 2}


def unit_makespan(schedule: Schedule, costs: dict[str, float] | None = None) -> float:
    """Finish time of one iteration when every rank runs its actions in order, as early as possible."""
    return simulate(schedule, UnitCost(times=dict(costs or UNIT))).iteration_time


def steady_period(schedule: Schedule, iterations: int = 4) -> float:
    """Time one more iteration adds in steady state, with no optimizer barrier between iterations."""
    return simulate(
        schedule, UnitCost(times=dict(UNIT)), iterations=iterations, step_barrier=False
    ).iteration_time


class ConstComm(ConstantComm):
    """Every transfer takes ``p2p`` and every all-reduce ``coll`` time units (nothing else expected)."""

    def __init__(self, p2p: float = 0.0, coll: float = 0.0) -> None:
        super().__init__(p2p, coll)

    def collective_time(self, kind: str, rank: int, nbytes: float, group: str = "dp", members=()) -> float:
        assert kind == "all_reduce"
        return self.collective
