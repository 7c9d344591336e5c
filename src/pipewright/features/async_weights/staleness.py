"""Version differences read from a schedule's action order (pure Python).

For an asynchronous schedule (optimizer steps ``STEP(s, k)`` inside the window), the weights a
microbatch's forward sees on stage s and those its backward meets differ by the number of updates of
stage s between the two actions: PipeOptim's prediction horizon s. For PipeDream's 1F1B without flush
this is p − r − 1 on rank r in the steady state (Guan et al. 2023, §3; the reference code uses p − r,
one too many), fewer for the first microbatches of a window. Nothing here is specific to one schedule:
the same count is right for interleaved or zero-bubble asynchronous variants.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipewright.ir import STEP, B, F, I, Schedule

BACKWARD_KINDS = (B, I)  # the action whose backward reads the weights (W needs no weights)


def staleness_table(schedule: Schedule) -> dict[tuple[int, int], int]:
    """{(stage, microbatch): updates of that stage between its F and its B (or I)}, for every stage
    and microbatch of the schedule (compute-only or lowered)."""
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
    """Updates of ``stage`` between the forward and the backward of ``microbatch``."""
    return staleness_table(schedule)[(stage, microbatch)]


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
