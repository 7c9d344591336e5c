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
from collections.abc import Iterator, Sequence

from pipewright.ir import Action, B, F, I, W
from pipewright.schedules.registry import ScheduleCosts


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


def walk(
    rows: Sequence[Sequence[Action]], placement: Sequence[int]
) -> Iterator[tuple[int, Action, tuple[int, str, int | None] | None]]:
    """Every action of ``rows`` in an order the list scheduler may run them: (rank, action, the
    (stage, kind, microbatch) it waits for on another stage or None), each after what it waits for
    (B stands for its I: its key's kind is I). Stops early when the orders cannot run to completion."""
    last = len(placement) - 1
    done: set[tuple[int, str, int | None]] = set()
    pos = [0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                kind, stage = a.kind, a.stage
                if kind == F:
                    key = (stage - 1, F, a.microbatch) if stage > 0 else None
                elif kind in (I, B):
                    key = (stage, F, a.microbatch) if stage == last else (stage + 1, I, a.microbatch)
                else:
                    key = None
                if key is not None and key not in done:
                    break
                done.add((stage, I if kind == B else kind, a.microbatch))
                pos[r] += 1
                progress = True
                yield r, a, key


def order_times(
    rows: Sequence[Sequence[Action]], placement: Sequence[int], costs: ScheduleCosts
) -> tuple[float, float]:
    """:func:`order_makespan` and :func:`order_span` from one pass over the orders."""
    backward = tuple(i + w for i, w in zip(costs.i, costs.w, strict=True))
    price = {F: costs.f, I: costs.i, W: costs.w, B: backward}
    end: dict[tuple[int, str, int | None], float] = {}
    clock = [0.0] * len(rows)
    first = [math.inf] * len(rows)
    count = 0
    for r, a, key in walk(rows, placement):
        kind, stage = a.kind, a.stage
        start = clock[r]
        if key is not None:
            hop = costs.comm if placement[key[0]] != r else 0.0
            start = max(start, end[key] + hop)
        t = price[kind][stage] if kind in price else 0.0
        first[r] = min(first[r], start)
        clock[r] = start + t
        end[(stage, I if kind == B else kind, a.microbatch)] = clock[r]
        count += 1
    if count < sum(len(row) for row in rows):
        return math.inf, math.inf
    spans = [c - f for c, f in zip(clock, first, strict=True) if f < math.inf]
    return max(clock, default=0.0), max(spans, default=0.0)
