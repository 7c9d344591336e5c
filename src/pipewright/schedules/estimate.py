"""The iteration time of compute-only orders under :class:`ScheduleCosts`, for generators that choose
between candidate orders.

Each rank runs its actions in order; an action starts when the rank is free and the action it needs has
ended — plus ``costs.comm`` when that action ran on another rank — and lasts its stage's cost
(list scheduling in max-plus algebra, the model of Qi et al. 2024 §3.1 and of sail-sg's schedulers).
Dependencies: F(s, k) after F(s − 1, k); I(s, k) after I(s + 1, k) (the last stage: after its F);
W(s, k) and B(s, k) after I(s, k) / F(s, k) as the rank orders them. Transfers do not queue, and kinds
other than F, I, B and W cost nothing, so this is an estimate; the simulator (``pipewright.sim``) is
the reference, and for the zero-bubble orders with constant transfer times the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipewright.ir import Action, B, F, I, W
from pipewright.schedules.schedule_info import ScheduleCosts


def order_makespan(rows: Sequence[Sequence[Action]], placement: Sequence[int], costs: ScheduleCosts) -> float:
    """Finish time of the last action of ``rows`` (per-rank orders) with stage s on rank
    ``placement[s]``; ``math.inf`` when the orders cannot run to completion. An I ends the backward
    of its stage for B's sake too (B = I + W of that stage)."""
    return order_times(rows, placement, costs)[0]


def order_span(rows: Sequence[Sequence[Action]], placement: Sequence[int], costs: ScheduleCosts) -> float:
    """The longest time any rank spends from the start of its first action to the end of its last: the
    objective of the Zero Bubble authors' scheduler, and about the period of iterations that follow each
    other without an optimizer barrier (the paper's post-validation); ``math.inf`` if they cannot run."""
    return order_times(rows, placement, costs)[1]


def order_times(
    rows: Sequence[Sequence[Action]], placement: Sequence[int], costs: ScheduleCosts
) -> tuple[float, float]:
    """:func:`order_makespan` and :func:`order_span` from one pass over the orders."""
    last = len(placement) - 1
    price = {F: costs.f, I: costs.i, W: costs.w}
    end: dict[tuple[int, str, int], float] = {}
    clock = [0.0] * len(rows)
    first = [math.inf] * len(rows)
    pos = [0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                kind, stage = a.kind, a.stage
                # the action on another stage that a waits for (None: only its rank's order)
                if kind == F:
                    key = (stage - 1, F, a.microbatch) if stage > 0 else None
                elif kind in (I, B):
                    key = (stage, F, a.microbatch) if stage == last else (stage + 1, I, a.microbatch)
                else:
                    key = None
                start = clock[r]
                if key is not None:
                    done = end.get(key)
                    if done is None:
                        break
                    hop = costs.comm if placement[key[0]] != r else 0.0
                    start = max(start, done + hop)
                if kind == B:
                    t = costs.i[stage] + costs.w[stage]
                else:
                    t = price[kind][stage] if kind in price else 0.0
                first[r] = min(first[r], start)
                clock[r] = start + t
                end[(stage, I if kind == B else kind, a.microbatch)] = clock[r]
                pos[r] += 1
                progress = True
    if any(p < len(row) for p, row in zip(pos, rows, strict=True)):
        return math.inf, math.inf
    spans = [c - f for c, f in zip(clock, first, strict=True) if f < math.inf]
    return max(clock, default=0.0), max(spans, default=0.0)
