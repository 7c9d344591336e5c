"""Classic synchronous schedules: GPipe and 1F1B (PipeDream-Flush).

Notation: p ranks, m microbatches; stage s = rank s. Bubble fractions are idle over ideal time.
"""

from __future__ import annotations

from fractions import Fraction

from pipewright.ir import Action, B, F, Schedule, loop_placement
from pipewright.schedules.registry import ScheduleInfo


def _schedule(name: str, p: int, m: int, rows: list[list[Action]], v: int = 1) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=p,
        num_stages=p * v,
        num_microbatches=m,
        placement=loop_placement(p, v),
        actions=tuple(tuple(r) for r in rows),
    )


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards.

    Bubble (p − 1)/m of the ideal time; every rank holds all m microbatches' activations at the peak.
    """
    rows = [[Action(r, F, k) for k in range(m)] + [Action(r, B, k) for k in range(m)] for r in range(p)]
    return _schedule("gpipe", p, m, rows)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs min(p − r − 1, m) warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards.

    Bubble (p − 1)/m as GPipe; peak activation memory min(p − r, m) microbatches on rank r (p on rank 0).
    """
    rows = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Action(r, F, k) for k in range(warm)]
        for k in range(m - warm):
            row += [Action(r, F, warm + k), Action(r, B, k)]
        row += [Action(r, B, k) for k in range(m - warm, m)]
        rows.append(row)
    return _schedule("1f1b", p, m, rows)


SCHEDULES = (
    ScheduleInfo(
        name="gpipe",
        build=gpipe,
        memory=lambda p, m, v: [Fraction(m)] * p,
        bubble="(p − 1)/m",
        memory_formula="m",
        source="Huang et al., GPipe, NeurIPS 2019",
    ),
    ScheduleInfo(
        name="1f1b",
        build=one_f_one_b,
        memory=lambda p, m, v: [Fraction(min(p - r, m)) for r in range(p)],
        bubble="(p − 1)/m",
        memory_formula="min(p − r, m) on rank r",
        source="Narayanan et al., PipeDream-Flush / Megatron-LM, SC21",
    ),
)
