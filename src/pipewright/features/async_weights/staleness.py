"""Version differences read from a schedule's action order (pure Python).

For an asynchronous schedule (optimizer steps ``STEP(s, k)`` inside the window), the weights a
microbatch's forward sees on stage s and those its backward meets differ by the number of updates of
stage s between the two actions: PipeOptim's prediction horizon s. For PipeDream's 1F1B without flush
this is p − r − 1 on rank r in the steady state (Guan et al. 2023, §3; the reference code uses p − r,
one too many), fewer for the first microbatches of a window. Nothing here is specific to one schedule:
the same count is right for interleaved or zero-bubble asynchronous variants. The count itself
lives beside the asynchronous schedules (:func:`pipewright.schedules.asynchronous.staleness_table`).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipewright.ir import STEP, F, Schedule
from pipewright.schedules.asynchronous import BACKWARD_KINDS, staleness, staleness_table

__all__ = ["check_async", "staleness", "staleness_table", "steady_staleness", "versions_in_flight"]


def steady_staleness(schedule: Schedule) -> dict[int, int]:
    """The largest version difference per stage (its steady-state value when m is large enough)."""
    out: dict[int, int] = {s: 0 for s in range(schedule.num_stages)}
    for (stage, _), s in staleness_table(schedule).items():
        out[stage] = max(out[stage], s)
    return out


def versions_in_flight(schedule: Schedule, *, until_step: bool = False) -> dict[int, int]:
    """Most distinct weight versions of each stage referenced at once by microbatches whose forward
    ran and whose backward has not (the live version included): what weight stashing keeps. With
    ``until_step`` a microbatch whose forward version is already superseded at its backward holds it
    until its own STEP (delay compensation reads it there; with a split backward the STEP comes
    after W, later than I)."""
    peak: dict[int, int] = {s: 1 for s in range(schedule.num_stages)}
    for row in schedule.actions:
        version: dict[int, int] = {}
        open_: dict[int, dict[int, int]] = {}  # stage → {microbatch: version at its forward}
        for a in row:
            mine = open_.get(a.stage, {})
            if a.kind == STEP or (a.kind in BACKWARD_KINDS and not until_step):
                mine.pop(a.microbatch, None)
            elif a.kind in BACKWARD_KINDS and mine.get(a.microbatch) == version.get(a.stage, 0):
                mine.pop(a.microbatch)  # still the live version at the backward: nothing to keep
            if a.kind == STEP:
                version[a.stage] = version.get(a.stage, 0) + 1
            elif a.kind == F:
                open_.setdefault(a.stage, {})[a.microbatch] = version.get(a.stage, 0)
            else:
                continue
            held = set(open_.get(a.stage, {}).values()) | {version.get(a.stage, 0)}
            peak[a.stage] = max(peak[a.stage], len(held))
    return peak


def check_async(schedule: Schedule) -> Mapping[tuple[int, int], int]:
    """The staleness table, after checking that every F has its B/I on the same row."""
    table = staleness_table(schedule)
    forwards = {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == F}
    missing = forwards - set(table)
    if missing:
        raise ValueError(f"{schedule.name}: forwards without a backward: {sorted(missing)[:4]}")
    return table
