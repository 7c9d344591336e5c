"""The automatic zero-bubble scheduler of Qi et al. (Zero Bubble Pipeline Parallelism, ICLR 2024, §3.1
"Automatic scheduling"): a memory-bounded greedy that builds each rank's order of F, I and W.

The greedy walks the ranks in time order (always the rank whose clock is earliest) and lets it pick:

1. ``I`` when its input gradient has arrived — the backward to the input is on the critical path;
2. ``F`` when its input has arrived and one more microbatch fits in ``memory_limit``: the warm-up runs
   as many forwards as memory allows (with ``staggered``, at most memory_limit − r on rank r, 1F1B's
   staircase); afterwards, with ``alternate``, F and I alternate (after an I the next F goes first,
   after an F no second F while an I is owed);
3. ``W`` (the oldest pending one) when memory would overflow, when all I are done (the final flush), or,
   with ``fill_gaps``, when the time until anything else can start is at least T_W;
4. otherwise it waits until the next input can have arrived.

The estimate is the greedy's own clock: each action starts at max(its rank's clock, the arrival of the
events it needs) and lasts its stage's cost; an arrival from another rank adds ``comm``. Unknown
arrivals are bounded below by the producing rank's clock plus its shortest action, so waiting never
skips one. The greedy runs once per flag combination (2³) and keeps the orders with the smallest
estimated makespan (ties: the first tried). A scheduling heuristic only; the simulator is elsewhere.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipewright.ir import Action, F, I, W

_INF = math.inf


@dataclass
class _Rank:
    clock: float = 0.0
    next_f: int = 0
    next_i: int = 0
    in_flight: int = 0
    pending_w: deque[int] = field(default_factory=deque)
    forwards_since_i: int = 0
    order: list[Action] = field(default_factory=list)


@dataclass(frozen=True)
class StageCosts:
    f: Sequence[float]
    i: Sequence[float]
    w: Sequence[float]
    comm: float


def greedy_orders(
    p: int, m: int, costs: StageCosts, memory_limit: int, *, fill_gaps: bool, alternate: bool, staggered: bool
) -> tuple[list[list[Action]], float]:
    """One greedy pass: the per-rank orders and their estimated makespan.

    Event-driven: the unfinished ranks wait in a heap keyed by (clock, rank), so each step takes the
    earliest in O(log p); the bound on unknown arrivals (the smallest clock + min(T_F, T_I) over the
    other unfinished ranks) comes from a second heap whose stale entries are dropped when they surface.
    """
    ranks = [_Rank() for _ in range(p)]
    f_end = [[_INF] * m for _ in range(p)]
    i_end = [[_INF] * m for _ in range(p)]
    shortest = [min(costs.f[q], costs.i[q]) for q in range(p)]
    total = 3 * m
    by_clock = [(0.0, q) for q in range(p)] if m > 0 else []  # already a heap
    # (clock + shortest action, rank, version): an entry counts while its version is the rank's current
    version = [0] * p
    by_arrival = [(shortest[q], q, 0) for q in range(p)] if m > 0 else []
    heapq.heapify(by_arrival)
    comm = costs.comm

    def run(st: _Rank, action: Action, start: float, cost: float) -> float:
        st.order.append(action)
        st.clock = start + cost
        return st.clock

    while by_clock:
        t, r = heapq.heappop(by_clock)
        version[r] += 1  # r's arrival entry is stale while r is being stepped
        st = ranks[r]
        can_i = st.next_i < st.next_f
        can_f = st.next_f < m and st.in_flight < memory_limit
        if staggered and st.next_i == 0 and st.next_f >= max(1, memory_limit - r):
            can_f = False
        if alternate and st.next_i > 0 and st.forwards_since_i >= 1 and can_i:
            can_f = False
        if can_i:
            k = st.next_i
            ready_i = f_end[r][k] if r == p - 1 else i_end[r + 1][k] + comm
        else:
            ready_i = _INF
        ready_f = (0.0 if r == 0 else f_end[r - 1][st.next_f] + comm) if can_f else _INF
        after_i = alternate and st.next_i > 0 and st.forwards_since_i == 0
        if ready_i <= t and not (after_i and ready_f <= t):
            k = st.next_i
            i_end[r][k] = run(st, Action(r, I, k), t, costs.i[r])
            st.next_i += 1
            st.pending_w.append(k)
            st.forwards_since_i = 0
        elif ready_f <= t:
            k = st.next_f
            f_end[r][k] = run(st, Action(r, F, k), t, costs.f[r])
            st.next_f += 1
            st.in_flight += 1
            st.forwards_since_i += 1
        else:
            # Arrival not yet known: it cannot come before the producing rank's clock plus one action.
            while by_arrival and by_arrival[0][2] != version[by_arrival[0][1]]:
                heapq.heappop(by_arrival)
            soonest = min(ready_i, ready_f, by_arrival[0][0] if by_arrival else _INF)
            overflow = st.next_f < m and st.in_flight >= memory_limit
            only_w = st.next_i == m
            if st.pending_w and (overflow or only_w or (fill_gaps and soonest - t >= costs.w[r])):
                k = st.pending_w.popleft()
                run(st, Action(r, W, k), t, costs.w[r])
                st.in_flight -= 1
            elif soonest == _INF:
                raise RuntimeError("zero-bubble greedy made no progress")  # a bug, not a user error
            else:
                st.clock = soonest  # wait: nothing this rank needs can arrive earlier
        if len(st.order) < total:
            heapq.heappush(by_clock, (st.clock, r))
            heapq.heappush(by_arrival, (st.clock + shortest[r], r, version[r]))
    makespan = max(st.clock for st in ranks)
    return [st.order for st in ranks], makespan


def all_orders(
    p: int, m: int, costs: StageCosts, memory_limit: int
) -> list[tuple[list[list[Action]], float]]:
    """The orders and estimates of every flag combination (the heuristic's fill choices)."""
    return [
        greedy_orders(
            p, m, costs, memory_limit, fill_gaps=fill_gaps, alternate=alternate, staggered=staggered
        )
        for fill_gaps, alternate, staggered in itertools.product((True, False), repeat=3)
    ]
