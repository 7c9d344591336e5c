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

from pipewright.ir import STEP, B, F, I, Schedule, loop_placement
from pipewright.schedules.classic import one_f_one_b_rows
from pipewright.schedules.schedule_info import ScheduleInfo

BACKWARD_KINDS = (B, I)  # the action whose backward reads the weights (W needs no weights)


def async_1f1b(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream 1F1B without flush: min(p − r − 1, m) warm-up forwards on rank r, then F, B, STEP per
    microbatch; the remaining backwards (each followed by its STEP) drain at the end of the window.

    In steady state no rank idles (the fill and drain are paid once per run, not per iteration).
    Peak activation memory min(p − r, m) microbatches on rank r, as 1F1B.
    """
    return Schedule.build(
        "async-1f1b", m, one_f_one_b_rows(p, m, step_after_backward=True), loop_placement(p), flush=False
    )


def staleness_table(schedule: Schedule) -> dict[tuple[int, int], int]:
    """{(stage, microbatch): updates of that stage between its F and its B (or I)}, for every stage
    and microbatch of an asynchronous schedule (compute-only or lowered): the number of ``STEP``
    actions of the stage between the two on the rank's action list. Nothing here assumes 1F1B."""
    table: dict[tuple[int, int], int] = {}
    for row in schedule.actions:
        steps: dict[int, int] = {}  # stage → STEP actions seen so far on this row
        at_forward: dict[tuple[int, int], int] = {}
        for a in row:
            if a.kind == STEP:
                steps[a.stage] = steps.get(a.stage, 0) + 1
            elif a.kind == F:
                at_forward[(a.stage, a.microbatch)] = steps.get(a.stage, 0)
            elif a.kind in BACKWARD_KINDS:
                key = (a.stage, a.microbatch)
                if key in at_forward:
                    table[key] = steps.get(a.stage, 0) - at_forward.pop(key)
    return table


def staleness(schedule: Schedule, stage: int, microbatch: int) -> int:
    """Optimizer steps ``stage`` takes between the forward and the backward of ``microbatch``.

    This is PipeOptim's s (the prediction horizon) read off the schedule: p − r − 1 on rank r in the
    steady state of :func:`async_1f1b`, fewer for the first microbatches of the window.
    """
    return staleness_table(schedule)[(stage, microbatch)]


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
