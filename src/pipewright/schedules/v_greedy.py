"""ZB-V as Qi et al. build it (Zero Bubble Pipeline Parallelism, ICLR 2024, §6 and the V-schedule
greedy of their reference code): a cost-aware greedy over the V placement.

Rank r holds leg 0 (stage r, the descending leg) and leg 1 (stage 2p − 1 − r). Every action is timed as
it is placed: it starts when its rank is free and its input has arrived (``comm`` after the producing
action on another rank) and lasts its stage's F, I or W time. Memory counts chunk-microbatches (F adds
one, W frees one) under a limit (2p by default, 1F1B's p microbatches of a rank's layers). Phases:

1. warm-up: one F0 on every rank; then, from rank p − 1 down, rank r runs F0 (and ranks below it one
   each) while the first F1 from rank r + 1 has not arrived and 2 + 2r more chunk-microbatches fit, then
   its first F1; then ranks r ≥ 1 run F of alternating legs, deepest rank first, until each has run at
   least as many F as the rank before it and one F1 more than it (or all of them);
2. 2m rounds, each one backward (I) per rank — leg 1 when both legs have run as many I, else leg 0 once
   its gradient has arrived — then one forward per rank (the leg whose input has arrived, F1 first).
   Before an action a rank runs its pending W while the wait for the action's input is at least a W
   long, and one more W when the wait exceeds what the largest bubble so far allows (for F only with
   ``fill_f``, for I of leg 1 only with ``fill_b``); a W also runs when memory is full;
3. the pending W.

The score is the largest per-rank bubble (idle time after the first F); each pass is rerun with its own
bubbles as the allowance (the paper's iterative refinement) while that lowers it, for each of the four
fill choices. :func:`candidates` returns every order tried; :mod:`pipewright.schedules.vshape` keeps
the fastest under :func:`pipewright.schedules.estimate.order_makespan`.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from pipewright.ir import Action, F, I, W
from pipewright.schedules.schedule_info import ScheduleCosts


class _Stuck(Exception):
    """The greedy reached a state its rules do not cover (few microbatches); that candidate is dropped."""


@dataclass
class _Rank:
    clock: float = 0.0
    mem: int = 0
    bubble: float = 0.0
    count: Counter[tuple[str, int]] = field(default_factory=Counter)
    pending: deque[tuple[int, int]] = field(default_factory=deque)
    order: list[Action] = field(default_factory=list)


class _VGreedy:
    def __init__(
        self, p: int, m: int, costs: ScheduleCosts, limit: int, allowance: list[float] | None
    ) -> None:
        self.p, self.m, self.costs, self.limit = p, m, costs, limit
        self.ranks = [_Rank() for _ in range(p)]
        self.end: dict[tuple[str, int, int, int], float] = {}
        self.allowance = allowance or [0.0] * p

    def stage(self, r: int, leg: int) -> int:
        return r if leg == 0 else 2 * self.p - 1 - r

    def upstream(self, kind: str, leg: int, r: int) -> tuple[str, int, int] | None:
        """(kind, leg, rank) whose action of the same microbatch this one waits for across ranks."""
        if kind == F:
            q = r - 1 if leg == 0 else r + 1
        elif kind == I:
            q = r + 1 if leg == 0 else r - 1
        else:
            return None
        return (kind, leg, q) if 0 <= q < self.p else None

    def arrival(self, kind: str, leg: int, r: int) -> float | None:
        """When the input of rank r's next (kind, leg) can be there; None: no cross-rank input;
        raises _Stuck when its producer has not been placed."""
        up = self.upstream(kind, leg, r)
        if up is None:
            return None
        key = (*up, self.ranks[r].count[(kind, leg)])
        if key not in self.end:
            raise _Stuck(key)
        return self.end[key] + self.costs.comm

    def cost(self, kind: str, stage: int) -> float:
        return {F: self.costs.f, I: self.costs.i, W: self.costs.w}[kind][stage]

    def put(self, r: int, kind: str, leg: int) -> None:
        st = self.ranks[r]
        k = st.count[(kind, leg)]
        if k >= self.m:
            raise _Stuck((kind, leg, r, k))
        stage = self.stage(r, leg)
        cost = self.cost(kind, stage)
        ready = self.arrival(kind, leg, r) if kind != W else None
        end = st.clock + cost if ready is None else max(st.clock, ready) + cost
        if st.count[(F, 0)] > 0:
            st.bubble += end - (st.clock + cost)
        st.clock = end
        self.end[(kind, leg, r, k)] = end
        st.count[(kind, leg)] += 1
        st.mem += {F: 1, I: 0, W: -1}[kind]
        if st.mem > self.limit:
            raise _Stuck(("memory", r))
        if kind == I:
            st.pending.append((leg, k))
        st.order.append(Action(stage, kind, k))

    def put_w(self, r: int) -> None:
        leg, _ = self.ranks[r].pending.popleft()
        self.put(r, W, leg)

    def allowed(self, r: int) -> float:
        """The idle time rank r may still take: the largest bubble so far (or the allowance's spread)
        less its own."""
        worst = max(max(st.bubble for st in self.ranks), max(self.allowance) - self.allowance[r])
        return worst - self.ranks[r].bubble

    def fill_before(self, r: int, kind: str, leg: int, extra_w: bool) -> None:
        """Pending W that fit before the input of (kind, leg) arrives, and one more if the wait exceeds
        the allowance and ``extra_w``."""
        ready = self.arrival(kind, leg, r)
        st = self.ranks[r]
        if ready is None:
            return
        while st.pending and ready >= st.clock + self.cost(W, self.stage(r, st.pending[0][0])):
            self.put_w(r)
        if st.pending and ready - st.clock > self.allowed(r) and extra_w:
            self.put_w(r)

    def warm_up(self) -> None:
        p, m, ranks = self.p, self.m, self.ranks
        for r in range(p):
            self.put(r, F, 0)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                target = self.end[(F, 1, r + 1, 0)] + self.costs.comm
                while (
                    ranks[r].mem + 2 + 2 * r <= self.limit
                    and ranks[r].clock + self.cost(F, r) <= target
                    and ranks[r].count[(F, 0)] < m
                ):
                    for q in range(r + 1):
                        self.put(q, F, 0)
            self.put(r, F, 1)
        leg = 0
        for r in range(1, p):
            here, before = ranks[r].count, ranks[r - 1].count
            while here[(F, 0)] + here[(F, 1)] < before[(F, 0)] + before[(F, 1)] or (
                here[(F, 1)] <= before[(F, 1)] < m
            ):
                for q in range(p - 1, r - 1, -1):
                    if ranks[q].count[(F, leg)] < m:
                        self.put(q, F, leg)
                leg = 1 - leg

    def backward_round(self, fill_b: bool) -> None:
        first, second = [], []
        for r, st in enumerate(self.ranks):
            c = st.count
            if c[(I, 0)] >= c[(I, 1)]:
                first.append(r)
            elif r == self.p - 1 or (I, 0, r + 1, c[(I, 0)]) in self.end or c[(I, 1)] >= self.m:
                second.append(r)
            else:
                first.append(r)
        for r, leg in [(r, 0) for r in reversed(second)] + [(r, 1) for r in first]:
            self.fill_before(r, I, leg, extra_w=leg == 0 or fill_b)
            self.put(r, I, leg)

    def forward_round(self, fill_f: bool) -> None:
        for r, st in enumerate(self.ranks):
            c = st.count
            if c[(F, 1)] >= self.m:
                continue
            if c[(F, 1)] >= c[(F, 0)]:
                leg = 0
            elif r == self.p - 1 or (F, 1, r + 1, c[(F, 1)]) in self.end:
                leg = 1
            elif c[(F, 0)] < self.m and (r == 0 or (F, 0, r - 1, c[(F, 0)]) in self.end):
                leg = 0
            else:
                continue
            while st.mem + 1 > self.limit:
                if not st.pending:
                    raise _Stuck(("memory", r))
                self.put_w(r)
            self.fill_before(r, F, leg, extra_w=fill_f)
            self.put(r, F, leg)

    def run(self, fill_f: bool, fill_b: bool) -> tuple[list[list[Action]], list[float]]:
        self.warm_up()
        for _ in range(2 * self.m):
            self.backward_round(fill_b)
            self.forward_round(fill_f)
        for r, st in enumerate(self.ranks):
            while st.pending:
                self.put_w(r)
        return [st.order for st in self.ranks], [st.bubble for st in self.ranks]


def candidates(p: int, m: int, costs: ScheduleCosts, limit: int) -> list[list[list[Action]]]:
    """Every order the greedy produces: the four fill choices, each refined with its own bubbles as the
    allowance while the largest bubble falls. ``limit``: chunk-microbatches per rank."""
    out = []
    for fill_b in (True, False):
        for fill_f in (True, False):
            allowance: list[float] | None = None
            best = None
            while True:
                try:
                    orders, bubbles = _VGreedy(p, m, costs, limit, allowance).run(fill_f, fill_b)
                except _Stuck:
                    break
                out.append(orders)
                if best is not None and max(bubbles) >= best:
                    break
                best, allowance = max(bubbles), bubbles
    return out
