"""Insert the data-parallel gradient reduction: ``REDUCE_GRAD(s)`` right after the last action of each
rank that completes a weight-gradient event of stage ``s`` (its last ``B`` or ``W``), so the reduction
of early-finishing stages overlaps the remaining backward work (as in Megatron-LM's overlapped DP)."""

from __future__ import annotations

from pipewright.deps import has_kind, produces
from pipewright.ir import REDUCE_GRAD, Action, Schedule, W


def add_grad_reduction(schedule: Schedule) -> Schedule:
    """``schedule`` with one REDUCE_GRAD per stage (unchanged if it already has any)."""
    if has_kind(schedule, REDUCE_GRAD):
        return schedule
    rows = []
    for row in schedule.actions:
        last: dict[int, int] = {}
        for pos, a in enumerate(row):
            for kind, stage, _, _ in produces(a, schedule):
                if kind == W:
                    last[stage] = pos
        after: dict[int, list[int]] = {}
        for stage, pos in last.items():
            after.setdefault(pos, []).append(stage)
        out: list[Action] = []
        for pos, a in enumerate(row):
            out.append(a)
            out.extend(Action(s, REDUCE_GRAD) for s in sorted(after.get(pos, ())))
        rows.append(out)
    return schedule.with_actions(rows)
