"""Asynchronous variants of synchronous schedules: the same order, each stage updating its weights
right after a microbatch's weight gradient is complete, with no flush.

:func:`make_asynchronous` inserts ``STEP(s, k)`` after the action that finishes stage s's weight
gradient of microbatch k (W(s, k) where the backward is split, else B(s, k)). The version difference
each microbatch meets (weight prediction's s) is then whatever the order implies:
:mod:`pipewright.features.async_weights.staleness` reads it off the result. Two are registered:

* ``async-zb-h1``: ZB-H1 (Qi et al., ICLR 2024) without its optimizer barrier. W(k) runs r backward
  steps after I(k) on rank r, so the update lands later and a forward meets up to p − 1 updates on
  every rank with m ≥ 2p (PipeDream's 1F1B: p − r − 1).
* ``async-interleaved-1f1b``: Megatron's interleaved 1F1B (v chunks per rank) with a STEP per chunk
  and microbatch; each chunk has its own version difference.
"""

from __future__ import annotations

from fractions import Fraction

from pipewright.ir import STEP, Action, B, Schedule, W
from pipewright.schedules.classic import check_interleaved, interleaved_1f1b, interleaved_memory
from pipewright.schedules.schedule_info import ScheduleInfo
from pipewright.schedules.zero_bubble import zb_h1


def make_asynchronous(schedule: Schedule, name: str) -> Schedule:
    """``schedule`` (compute-only) with STEP(s, k) after each stage's last gradient action of k."""
    split = {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == W}
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for a in row:
            out.append(a)
            key = (a.stage, a.microbatch)
            if (a.kind == W) or (a.kind == B and key not in split):
                out.append(Action(a.stage, STEP, a.microbatch))
        rows.append(out)
    return schedule.with_actions(rows, name=name, meta={**schedule.meta, "flush": False})


def async_zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1's order with a STEP after every W and no flush (see the module docstring)."""
    return make_asynchronous(zb_h1(p, m), "async-zb-h1")


def async_interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B's order with a STEP after every B and no flush (see the module docstring)."""
    return make_asynchronous(interleaved_1f1b(p, m, v), "async-interleaved-1f1b")


SCHEDULES = (
    ScheduleInfo(
        name="async-zb-h1",
        build=async_zb_h1,
        memory=lambda p, m, v: [Fraction(min(p, m))] * p,
        bubble="0 in steady state (no flush)",
        memory_formula="min(p, m) on every rank; up to p weight versions (W delayed r steps)",
        source="Qi et al., ZB-H1, ICLR 2024, made asynchronous as PipeDream (Narayanan et al., 2019)",
        synchronous=False,
    ),
)

#: Interleaved variant: one model chunk per stage id, v per rank. Registered through the
#: async_weights feature bundle (``Features.schedules``), not the default families, because suites
#: that run every registered asynchronous schedule assume one stage per rank.
ASYNC_INTERLEAVED = ScheduleInfo(
    name="async-interleaved-1f1b",
    build=async_interleaved_1f1b,
    memory=interleaved_memory,
    bubble="0 in steady state (no flush)",
    memory_formula="as interleaved-1f1b; weight versions per chunk from its order",
    source="Narayanan et al., SC21 (interleaved 1F1B), made asynchronous as PipeDream",
    chunks=None,
    default_chunks=2,
    min_microbatches=lambda p, v: p,
    check=check_interleaved,
    synchronous=False,
)
