"""Where a rank idles in one simulated iteration: its bubbles and when its F/I/W events end (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipewright.ir import Action, B, F, I, Schedule, W

EPS = 1e-12


@dataclass(frozen=True)
class Gap:
    """An idle interval [start, end) of a rank in iteration 0; tasks go in before row index ``pos``."""

    start: float
    end: float
    pos: int


def skip_sends(row: tuple[Action, ...], pos: int, schedule: Schedule) -> int:
    while pos < len(row) and schedule.kinds[row[pos].kind].comm == "send":
        pos += 1
    return pos


def rank_gaps(schedule: Schedule, sim, rank: int, period: float) -> list[Gap]:
    """Idle gaps of ``rank`` in iteration 0 of ``sim`` (a simulation of lowered ``schedule``)."""
    row = schedule.actions[rank]
    spans = [(i, s, e) for i, (a, s, e) in enumerate(sim.spans_of(rank)) if schedule.kinds[a.kind].compute]
    gaps: list[Gap] = []
    t, pos = 0.0, 0
    for i, s, e in spans:
        if s - t > EPS:
            gaps.append(Gap(t, s, pos))
        t = max(t, e)
        pos = skip_sends(row, i + 1, schedule)
    if period - t > EPS:
        gaps.append(Gap(t, period, len(row)))
    return gaps


def event_ends(schedule: Schedule, sim, rank: int) -> dict[tuple, float]:
    """End time in iteration 0 of each F/I/W event produced on ``rank``."""
    ends: dict[tuple, float] = {}
    for a, _, e in sim.spans_of(rank):
        if a.kind == F:
            ends[(F, a.stage, a.microbatch)] = e
        elif a.kind in (B, I):
            ends[(I, a.stage, a.microbatch)] = e
        if a.kind in (B, W):
            ends[(W, a.stage, a.microbatch)] = e
    return ends


def take(gaps: list[Gap], uses: Iterable[tuple[float, float]]) -> list[Gap]:
    """Remove preconditioning time from the gap that begins when it starts."""
    out = list(gaps)
    for start, dur in uses:
        for i, g in enumerate(out):
            if g.start >= start - 1e-9 and g.start - start <= 1e-9 + 0.0:
                out[i] = Gap(min(g.end, g.start + dur), g.end, g.pos)
                break
    return [g for g in out if g.end - g.start > EPS]
