"""The event-driven zero-bubble greedy (``schedules/zb_greedy.py``) builds exactly the orders of the
straightforward version it replaced, which rescanned every rank on each step; that version is kept here,
unchanged, as the reference. Grid: p ∈ {1, 2, 3, 5}, m ∈ {1, 2, 5, 9}, unit and mixed per-stage
costs with transfer times 0 … 0.5, memory limits 1, p and 2p − 1, every flag combination; one larger
case (p = 16, m = 32, limits p and 2p) besides."""

from __future__ import annotations

import itertools
import math
import random
from collections import deque

from pipewright.ir import Action, F, I, W
from pipewright.schedules.zb_greedy import StageCosts, all_orders

_INF = math.inf


def _reference(p, m, costs, memory_limit, *, fill_gaps, alternate, staggered):
    """The O(p)-per-step greedy as it was: pick the earliest busy rank by a scan, bound unknown arrivals
    by a scan over the other busy ranks."""
    clock = [0.0] * p
    next_f, next_i, in_flight, since_i = [0] * p, [0] * p, [0] * p, [0] * p
    pending = [deque() for _ in range(p)]
    order = [[] for _ in range(p)]
    f_end = [[_INF] * m for _ in range(p)]
    i_end = [[_INF] * m for _ in range(p)]
    while True:
        busy = [r for r in range(p) if len(order[r]) < 3 * m]
        if not busy:
            break
        r = min(busy, key=lambda q: (clock[q], q))
        t = clock[r]
        can_i = next_i[r] < next_f[r]
        can_f = next_f[r] < m and in_flight[r] < memory_limit
        if staggered and next_i[r] == 0 and next_f[r] >= max(1, memory_limit - r):
            can_f = False
        if alternate and next_i[r] > 0 and since_i[r] >= 1 and can_i:
            can_f = False
        ready_i = _INF
        if can_i:
            k = next_i[r]
            ready_i = f_end[r][k] if r == p - 1 else i_end[r + 1][k] + costs.comm
        ready_f = _INF
        if can_f:
            ready_f = 0.0 if r == 0 else f_end[r - 1][next_f[r]] + costs.comm
        after_i = alternate and next_i[r] > 0 and since_i[r] == 0
        if ready_i <= t and not (after_i and ready_f <= t):
            k = next_i[r]
            order[r].append(Action(r, I, k))
            clock[r] = i_end[r][k] = t + costs.i[r]
            next_i[r] += 1
            pending[r].append(k)
            since_i[r] = 0
            continue
        if ready_f <= t:
            k = next_f[r]
            order[r].append(Action(r, F, k))
            clock[r] = f_end[r][k] = t + costs.f[r]
            next_f[r] += 1
            in_flight[r] += 1
            since_i[r] += 1
            continue
        soonest = min(ready_i, ready_f, *(clock[q] + min(costs.f[q], costs.i[q]) for q in busy if q != r))
        overflow = next_f[r] < m and in_flight[r] >= memory_limit
        if pending[r] and (overflow or next_i[r] == m or (fill_gaps and soonest - t >= costs.w[r])):
            order[r].append(Action(r, W, pending[r].popleft()))
            clock[r] = t + costs.w[r]
            in_flight[r] -= 1
            continue
        assert soonest < _INF
        clock[r] = soonest
    return order, max(clock)


def _reference_all(p, m, costs, limit):
    return [
        _reference(p, m, costs, limit, fill_gaps=a, alternate=b, staggered=c)
        for a, b, c in itertools.product((True, False), repeat=3)
    ]


def _cases():
    rng = random.Random(1)
    for p, m in itertools.product((1, 2, 3, 5), (1, 2, 5, 9)):
        for mixed in (False, True):
            if mixed:
                f = [rng.choice((0.5, 1.0, 1.5, 2.0)) for _ in range(p)]
                i = [rng.choice((0.5, 1.0, 2.0)) for _ in range(p)]
                w = [rng.choice((0.25, 1.0, 1.5)) for _ in range(p)]
                comm = rng.choice((0.0, 0.1, 0.5))
            else:
                f = i = w = [1.0] * p
                comm = 0.0
            for limit in sorted({1, p, 2 * p - 1}):
                yield p, m, StageCosts(f, i, w, comm), limit


def test_same_orders_and_makespans_as_the_rescanning_greedy_on_a_grid():
    n = 0
    for p, m, costs, limit in _cases():
        assert all_orders(p, m, costs, limit) == _reference_all(p, m, costs, limit), (p, m, costs, limit)
        n += 1
    assert n == 80


def test_same_orders_at_sixteen_stages():
    p, m = 16, 32
    f = [1.2] + [1.0] * (p - 2) + [1.5]
    costs = StageCosts(f, [1.1] + [1.0] * (p - 2) + [1.7], [0.7] * p, 0.05)
    for limit in (p, 2 * p):
        assert all_orders(p, m, costs, limit) == _reference_all(p, m, costs, limit), limit
