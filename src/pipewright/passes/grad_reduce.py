"""Insert the data-parallel gradient reduction, one ``REDUCE_GRAD(s)`` per stage ``s``:

- overlapped (:func:`add_grad_reduction`, pipewright's executor; Megatron-LM's ``--overlap-grad-reduce``):
  right after the last action of each rank that completes a weight-gradient event of ``s`` (its last
  ``B`` or ``W``), so the reduction of early-finishing stages overlaps the remaining backward work;
- after the pipeline (:func:`append_grad_reduction`, Megatron-LM's default and the SC21 paper's runs):
  appended to each rank's actions once its pipeline has drained, last stage's first.
"""

from __future__ import annotations

from pipewright.deps import has_kind, produces
from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD, STEP, Action, Schedule, W

#: ``--grad-reduce`` choices: where the REDUCE_GRAD actions go (module docstring).
GRAD_REDUCE = ("after", "overlap")


def with_grad_reduction(schedule: Schedule, mode: str = "overlap") -> Schedule:
    """``schedule`` with REDUCE_GRAD placed by ``mode`` ("after" or "overlap"; see the module docstring)."""
    if mode not in GRAD_REDUCE:
        raise ConfigError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)} (got {mode!r})")
    return append_grad_reduction(schedule) if mode == "after" else add_grad_reduction(schedule)


def append_grad_reduction(schedule: Schedule) -> Schedule:
    """``schedule`` with a REDUCE_GRAD of every stage appended to its rank's actions (not overlapped;
    unchanged if it already has any)."""
    return _append_per_stage(schedule, REDUCE_GRAD)


def _append_per_stage(schedule: Schedule, kind: str) -> Schedule:
    """``schedule`` with ``kind(s)`` of every stage appended to its rank's actions, last stage first
    (unchanged if it already has any)."""
    if has_kind(schedule, kind):
        return schedule
    rows = [
        (*row, *(Action(s, kind) for s in reversed(schedule.stages_of(r))))
        for r, row in enumerate(schedule.actions)
    ]
    return schedule.with_actions(rows)


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


def append_optimizer_step(schedule: Schedule) -> Schedule:
    """``schedule`` with each stage's optimizer step ``STEP(s)`` appended to its rank's actions, after
    its gradient reduction (unchanged if it already has any STEP): what the cost model prices as the
    optimizer's bytes (:attr:`pipewright.cost.efficiency.Efficiency.optimizer_bytes`)."""
    return _append_per_stage(schedule, STEP)
