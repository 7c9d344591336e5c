"""Test-only helper: the one-iteration makespan of a compute-only schedule with unit costs.

Not the simulator (that lives on branch ``sim``): this list-schedules every rank's actions in its own
order, each starting as soon as its rank is free and every event it requires (``deps.requires``) has
been produced (``deps.produces``); communication is free. Costs per chunk action: F = I = W = 1, B = 2.
"""

from __future__ import annotations

from pipewright.deps import produces, requires
from pipewright.ir import Schedule

UNIT = {"F": 1, "I": 1, "W": 1, "B": 2}


def unit_makespan(schedule: Schedule, costs: dict[str, float] | None = None) -> float:
    """Finish time of the last action when every rank runs its actions in order, as early as possible."""
    costs = costs or UNIT
    rows = schedule.actions
    ptr = [0] * len(rows)
    free = [0.0] * len(rows)
    done: dict[tuple, float] = {}
    remaining = sum(len(r) for r in rows)
    while remaining:
        progress = False
        for rank, row in enumerate(rows):
            while ptr[rank] < len(row):
                a = row[ptr[rank]]
                needs = requires(a, schedule)
                if not all(ev in done for ev in needs):
                    break
                start = max([free[rank], *(done[ev] for ev in needs)])
                free[rank] = start + costs.get(a.kind, 0)
                for ev in produces(a, schedule):
                    done[ev] = free[rank]
                ptr[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise AssertionError(f"{schedule.name} cannot run to completion")
    return max(free)


def repeat(schedule: Schedule, iterations: int) -> Schedule:
    """``iterations`` back-to-back copies of one iteration without a barrier between them (microbatches
    of copy j are renumbered j·m..j·m + m − 1), for steady-state checks."""
    m = schedule.num_microbatches
    rows = [
        [a._replace(microbatch=a.microbatch + j * m) for j in range(iterations) for a in row]
        for row in schedule.actions
    ]
    return schedule.with_actions(rows, num_microbatches=m * iterations)


def steady_period(schedule: Schedule, iterations: int = 4) -> float:
    """Time one more iteration adds once the pipeline is in steady state (no optimizer barrier)."""
    return unit_makespan(repeat(schedule, iterations)) - unit_makespan(repeat(schedule, iterations - 1))
