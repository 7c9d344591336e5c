"""Asynchronous schedules: no flush, each stage steps its optimizer on its own.

PipeDream's 1F1B without a flush (Narayanan et al., SOSP 2019; the baseline of PipeOptim, Guan et al.
2023): stage r runs p − r − 1 warm-up forwards, then alternates one forward and one backward, and
updates its weights right after every backward (``STEP(r, k)``, which :mod:`pipewright.deps` lets run
once ``W(r, k)`` is done). A forward on stage r therefore sees weights that are p − r − 1 updates older
than those its backward meets: weight stashing keeps up to p − r versions, weight prediction
(:mod:`pipewright.features.async_weights`) extrapolates them.
"""

from __future__ import annotations

from fractions import Fraction

from pipewright.ir import STEP, Action, B, F, I, Schedule, loop_placement
from pipewright.schedules.classic import one_f_one_b_rows
from pipewright.schedules.registry import ScheduleInfo


def async_1f1b(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream 1F1B without flush: min(p − r − 1, m) warm-up forwards on rank r, then F, B, STEP per
    microbatch; the remaining backwards (each followed by its STEP) drain at the end of the window.

    In steady state no rank idles (the fill and drain are paid once per run, not per iteration).
    Peak activation memory min(p − r, m) microbatches on rank r, as 1F1B.
    """
    return Schedule.build(
        "async-1f1b", m, one_f_one_b_rows(p, m, step_after_backward=True), loop_placement(p), flush=False
    )


def staleness(schedule: Schedule, stage: int, microbatch: int) -> int:
    """Optimizer steps ``stage`` takes between the forward and the backward of ``microbatch``.

    This is PipeOptim's s (the prediction horizon) read off the schedule: p − r − 1 on rank r in the
    steady state of :func:`async_1f1b`, fewer for the first microbatches of the window.
    """
    row = schedule.actions[schedule.rank_of(stage)]
    start = row.index(Action(stage, F, microbatch))
    backward = {Action(stage, B, microbatch), Action(stage, I, microbatch)}
    end = next(i for i, a in enumerate(row) if a in backward)
    return sum(1 for a in row[start:end] if a.stage == stage and a.kind == STEP)


SCHEDULES = (
    ScheduleInfo(
        name="async-1f1b",
        build=async_1f1b,
        memory=lambda p, m, v: [Fraction(min(p - r, m)) for r in range(p)],
        bubble="0 in steady state (no flush)",
        memory_formula="min(p − r, m) on rank r; up to p − r weight versions",
        source="Narayanan et al., PipeDream, SOSP 2019; Guan et al., PipeOptim, 2023",
        synchronous=False,
    ),
)
