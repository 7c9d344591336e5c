"""The refinement of Zero Bubble's automatic schedule: an integer linear program over the order of each
rank's F, I and W passes, started from the heuristic's order (Qi et al., Zero Bubble Pipeline
Parallelism, ICLR 2024, §3.1 and Appendix G; the authors' ``build_ilp`` in sail-sg's ``zb.py``).

Variables, for every pass j = (kind, stage s, microbatch k), kind ∈ {F, I, W}: its end time E_j ≥ T_j
(T: the stage's cost of that kind), and for two passes a, b of one rank whose order is not already
forced a binary x_ab (1: a runs before b). Constraints:

- dependencies, with the transfer time c between ranks: E_F(s,k) ≥ E_F(s−1,k) + c + T_F(s);
  E_I(s,k) ≥ E_I(s+1,k) + c + T_I(s) (the last stage: ≥ E_F(p−1,k) + T_I); E_W(s,k) ≥ E_I(s,k) + T_W;
- each kind in microbatch order on its rank (the heuristic's, the reference's and the handcrafted
  orders all keep it): E_X(s,k) ≥ E_X(s,k−1) + T_X;
- one pass at a time: E_b ≥ E_a + T_b − M_ab(1 − x_ab) and E_a ≥ E_b + T_a − M_ba·x_ab, with M the
  tightest constant the time bounds below allow;
- memory: F adds a microbatch, W frees it (:func:`pipewright.ir.peak_in_flight`'s model), so at most L
  in flight means F(s, k) starts after W(s, k − L) — with W in microbatch order that single precedence
  is the paper's cumulative constraint ΔM(F) + Σ_{before} ΔM ≤ L;
- bounds: every E_j between its earliest end (longest path of the forced precedences) and the
  heuristic's makespan H minus the longest forced path after j; the first F of each rank ends at its
  earliest, as the as-soon-as-possible execution runs it.

Objective: the makespan max_s E_W(s,m−1) — or, for orders run without an optimizer barrier (ZB-2p
with post-validation), the paper's max over ranks of E_W(s,m−1) − E_F(s,0) + T_F(s), with the makespan
as a 10⁻³-weighted second term.

Also the reference's strengthening rows: the objective is at least any pass's end plus the work its
rank still has after it (a sum over the binaries).

The paper warm-starts its solver with the heuristic's schedule. scipy's ``milp`` (HiGHS) takes no
starting point, so the start enters as the bound H and, above ``WHOLE_PAIRS`` open pairs, as a
neighbourhood: one slab of consecutive microbatches is free at a time, every pair outside it keeps the
start's order (per rank, pass and other kind two forced precedences express it), slabs visited
cool-down first, then warm-up, then the middle, each improvement re-centring the next, until a pass
over all slabs brings no gain or the time limit is spent. Up to ``WHOLE_PAIRS`` (p = 4, m = 8) it is
the paper's whole ILP. The solved order is re-timed as soon as possible
(:func:`pipewright.schedules.estimate.order_times`) and returned only when that is strictly better than
the start: the refinement never makes a schedule slower. When the start already meets the lower bound
of :func:`_floors` no solve runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from pipewright.ir import Action, F, I, W, loop_placement, peak_in_flight
from pipewright.schedules.schedule_info import ScheduleCosts

_KINDS = (F, I, W)
#: free pairs (binaries) per solve: up to this many the whole ILP, beyond it one slab of microbatches
#: at a time (:func:`_refine_by_slabs`)
WHOLE_PAIRS = 400
#: free pairs per slab solve at most
SLAB_PAIRS = 1500
#: relative optimality gap at which a solve stops (the reference stops at an absolute 0.5 of its units)
GAP = 1e-3


@dataclass(frozen=True)
class Refined:
    """What a refinement did: the orders (None: no gain), the start's and the result's score
    ((span, makespan) or (makespan,)), solves run and the seconds they took, the window (or slab of
    microbatches) used, whether the result is proven optimal (to the solver's gap), and the lower
    bound on the score's first term (:func:`_floors`; 0 where none was computed)."""

    rows: list[list[Action]] | None
    start_score: tuple[float, ...]
    score: tuple[float, ...]
    solves: int
    seconds: float
    window: int
    proven: bool = False
    bound: float = 0.0


def scipy_available() -> bool:
    """Whether ``scipy.optimize.milp`` can be imported (the ``pipewright[ilp]`` extra)."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


class _Problem:
    """Index of the passes of a one-chunk pipeline and its forced precedences."""

    def __init__(self, p: int, m: int, costs: ScheduleCosts, limit: int) -> None:
        self.p, self.m, self.costs, self.limit = p, m, costs, limit
        self.n = 3 * p * m
        self.cost = [0.0] * self.n
        price = (costs.f, costs.i, costs.w)
        for kind in range(3):
            for s in range(p):
                for k in range(m):
                    self.cost[self.id(kind, s, k)] = float(price[kind][s])
        # forced precedences: (before, after, delay)
        self.edges: list[tuple[int, int, float]] = []
        c = float(costs.comm)
        for s in range(p):
            for k in range(m):
                f, i, w = self.id(0, s, k), self.id(1, s, k), self.id(2, s, k)
                if s > 0:
                    self.edges.append((self.id(0, s - 1, k), f, c))
                self.edges.append((self.id(1, s + 1, k), i, c) if s < p - 1 else (f, i, 0.0))
                self.edges.append((i, w, 0.0))
                if k > 0:
                    for kind in range(3):
                        self.edges.append((self.id(kind, s, k - 1), self.id(kind, s, k), 0.0))
                if k >= limit:
                    self.edges.append((self.id(2, s, k - limit), f, 0.0))

    def id(self, kind: int, s: int, k: int) -> int:
        return (kind * self.p + s) * self.m + k

    def topological(self) -> list[int]:
        """Microbatch by microbatch: F up the stages, I down, then W (every forced edge goes forward)."""
        order = []
        for k in range(self.m):
            order += [self.id(0, s, k) for s in range(self.p)]
            order += [self.id(1, s, k) for s in reversed(range(self.p))]
            order += [self.id(2, s, k) for s in range(self.p)]
        return order


def _bounds(prob: _Problem, extra: list[tuple[int, int, float]], horizon: float):
    """Earliest end of every pass and the latest end that still meets ``horizon``, by one pass over
    :meth:`_Problem.topological` each way. An ``extra`` edge that runs against that order (a slab's
    fixed pair, e.g. F(s, k) before I(s, j < k)) only loosens the bounds: both stay valid."""
    preds: list[list[tuple[int, float]]] = [[] for _ in range(prob.n)]
    succs: list[list[tuple[int, float]]] = [[] for _ in range(prob.n)]
    for a, b, d in (*prob.edges, *extra):
        preds[b].append((a, d))
        succs[a].append((b, d))
    topo = prob.topological()
    lb = [0.0] * prob.n
    for j in topo:
        lb[j] = max((lb[a] + d for a, d in preds[j]), default=0.0) + prob.cost[j]
    ub = [horizon] * prob.n
    for j in reversed(topo):
        ub[j] = min((ub[b] - d - prob.cost[b] for b, d in succs[j]), default=horizon)
    return lb, ub


def _window_edges(prob: _Problem, rows: Sequence[Sequence[Action]], window: int, slab=None):
    """Free pairs within ``window`` positions of each other in ``rows`` (and, with ``slab`` = (lo, hi),
    of microbatches lo … hi − 1 only), and the forced edges that keep the other pairs in ``rows``'
    order."""
    lo_k, hi_k = slab or (0, prob.m)
    pairs: list[tuple[int, int]] = []  # (a, b): a's position before b's in rows
    edges: list[tuple[int, int, float]] = []
    kind_index = {F: 0, I: 1, W: 2}
    for s, row in enumerate(rows):
        pos = {(kind_index[a.kind], a.microbatch): n for n, a in enumerate(row)}
        for ka in range(3):
            for kb in range(ka + 1, 3):
                for k in range(prob.m):
                    a, pa = prob.id(ka, s, k), pos[(ka, k)]
                    before, after = -1, prob.m  # the fixed partners nearest to a on either side
                    for j in range(max(0, k - prob.limit + 1), k):  # the pairs left open
                        pb = pos[(kb, j)]
                        if abs(pa - pb) <= window and lo_k <= j and k < hi_k:
                            b = prob.id(kb, s, j)
                            pairs.append((a, b) if pa < pb else (b, a))
                        elif pb < pa:
                            before = max(before, j)
                        else:
                            after = min(after, j)
                    # kb's passes run in microbatch order, so one edge per side keeps every fixed pair
                    if before >= 0:
                        edges.append((prob.id(kb, s, before), a, 0.0))
                    if after < prob.m:
                        edges.append((a, prob.id(kb, s, after), 0.0))
    return pairs, edges


def _open_pairs(prob: _Problem, lo: int = 0, hi: int | None = None) -> int:
    """How many pairs the forced precedences leave open among microbatches lo … hi − 1: on every
    rank and for each of the three pairs of kinds, (k, j) with max(lo, k − L + 1) ≤ j < k."""
    hi = prob.m if hi is None else hi
    per_kind_pair = sum(k - max(lo, k - prob.limit + 1) for k in range(lo, hi) if k > lo)
    return 3 * prob.p * per_kind_pair


def _floors(prob: _Problem, lb: list[float]) -> tuple[float, float]:
    """Lower bounds on the makespan and on the largest rank span: every pass's earliest end, and each
    rank's first forward at its earliest followed by all of the rank's work without a gap."""
    makespan, span = max(lb), 0.0
    for s in range(prob.p):
        work = sum(prob.cost[prob.id(kind, s, k)] for kind in range(3) for k in range(prob.m))
        first = prob.id(0, s, 0)
        makespan = max(makespan, lb[first] - prob.cost[first] + work)
        span = max(span, work)
    return makespan, span


class _Rows:
    """The MILP's constraint rows, ``Σ coefficient · variable ≥ lower``, as sparse triplets."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []

    def add(self, terms: Iterable[tuple[int, float]], lower: float) -> None:
        r = len(self.lower)
        for col, v in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(v)
        self.lower.append(lower)


def _order_constraints(out: _Rows, prob: _Problem, pairs, fixed, lb, ub, x0: int) -> None:
    """Precedence rows of the fixed edges, and per same-rank pair (a, b) with binary x: b after a
    when x = 1, a after b when x = 0 (big-M from the bounds)."""
    for a, b, d in (*prob.edges, *fixed):
        out.add([(b, 1.0), (a, -1.0)], prob.cost[b] + d)
    for t, (a, b) in enumerate(pairs):
        x = x0 + t
        m_ab = ub[a] + prob.cost[b] - lb[b]  # x = 0 relaxes "b after a" by this much
        m_ba = ub[b] + prob.cost[a] - lb[a]
        out.add([(b, 1.0), (a, -1.0), (x, -m_ab)], prob.cost[b] - m_ab)
        out.add([(a, 1.0), (b, -1.0), (x, m_ba)], prob.cost[a])


def _objective_constraints(out: _Rows, prob: _Problem, rows, pairs, x0: int, c_var: int, s_var: int) -> None:
    """The reference's objective rows: makespan (and span from the rank's first forward) at least
    every pass's end plus the work its rank still has after it."""
    after: list[list[tuple[int, float]]] = [[] for _ in range(prob.n)]  # node → (binary, ± cost) terms
    tail = [0.0] * prob.n
    for t, (a, b) in enumerate(pairs):
        after[a].append((x0 + t, prob.cost[b]))  # b runs after a when x = 1
        tail[a] -= prob.cost[b]
        after[b].append((x0 + t, -prob.cost[a]))  # a runs after b when x = 0
        tail[b] += prob.cost[a]
    for s, row in enumerate(rows):
        first = prob.id(0, s, 0)
        left = 0.0
        for a in reversed(row):
            j = prob.id(_KINDS.index(a.kind), s, a.microbatch)
            const = tail[j] + left
            out.add([(c_var, 1.0), (j, -1.0), *((x, -v) for x, v in after[j])], const)
            span_terms = [(s_var, 1.0), (j, -1.0), *((x, -v) for x, v in after[j])]
            if j != first:
                out.add([*span_terms, (first, 1.0)], const + prob.cost[first])
            left += prob.cost[j]


def _orders(prob: _Problem, ends) -> list[list[Action]]:
    """Each rank's passes ordered by their start in a solution (ties: F, I, W)."""
    out = []
    for s in range(prob.p):
        passes = [(kind, k) for kind in range(3) for k in range(prob.m)]
        passes.sort(key=lambda q: (ends[prob.id(q[0], s, q[1])] - prob.cost[prob.id(q[0], s, q[1])], q[0]))
        out.append([Action(s, _KINDS[kind], k) for kind, k in passes])
    return out


def _solve(prob: _Problem, rows, window: int, horizon: float, steady: bool, time_limit: float, slab=None):
    """One MILP over ``rows``' neighbourhood: the per-rank orders of its solution (None: none found)
    and whether the solver proved it optimal within the neighbourhood (to its gap)."""
    import numpy as np
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_array

    pairs, fixed = _window_edges(prob, rows, window, slab)
    lb, ub = _bounds(prob, fixed, horizon)
    if any(lo > hi + 1e-9 for lo, hi in zip(lb, ub, strict=True)):
        return None, True
    n, p = prob.n, prob.p
    c_var, s_var = n, n + 1  # makespan, span
    x0 = n + 2
    nvar = x0 + len(pairs)
    cons = _Rows()
    _order_constraints(cons, prob, pairs, fixed, lb, ub, x0)
    _objective_constraints(cons, prob, rows, pairs, x0, c_var, s_var)
    a_mat = coo_array((cons.vals, (cons.rows, cons.cols)), shape=(len(cons.lower), nvar)).tocsr()
    floor_c, floor_s = _floors(prob, lb)
    lower = np.array(lb + [floor_c, floor_s] + [0.0] * len(pairs))
    upper = np.array(ub + [horizon, horizon] + [1.0] * len(pairs))
    for s in range(p):  # each rank's first forward as soon as possible
        upper[prob.id(0, s, 0)] = lb[prob.id(0, s, 0)]
    objective = np.zeros(nvar)
    if steady:
        objective[s_var], objective[c_var] = 1.0, 1e-3
    else:
        objective[c_var] = 1.0
    integrality = np.zeros(nvar)
    integrality[x0:] = 1
    res = milp(
        objective,
        integrality=integrality,
        bounds=(lower, upper),
        constraints=LinearConstraint(a_mat, np.array(cons.lower), np.full(len(cons.lower), np.inf)),
        options={"time_limit": max(time_limit, 0.01), "presolve": True, "mip_rel_gap": GAP},
    )
    if res.x is None:
        return None, False
    return _orders(prob, res.x[:n]), res.status == 0


def _in_kind_order(rows: Sequence[Sequence[Action]], m: int) -> bool:
    """Every rank runs F, I and W of its own stage once per microbatch, each kind in microbatch order."""
    for s, row in enumerate(rows):
        seen = {F: [], I: [], W: []}
        for a in row:
            if a.stage != s or a.kind not in seen:
                return False
            seen[a.kind].append(a.microbatch)
        if any(ks != list(range(m)) for ks in seen.values()):
            return False
    return True


def _score(rows, p: int, m: int, costs: ScheduleCosts, limit: int, steady: bool) -> tuple[float, ...]:
    from pipewright.ir import Schedule
    from pipewright.schedules.estimate import order_times

    makespan, span = order_times(rows, loop_placement(p), costs)
    sched = Schedule.build("zb-auto", m, rows, loop_placement(p))
    if max(peak_in_flight(sched)) > limit:
        return (math.inf, math.inf) if steady else (math.inf,)
    return (span, makespan) if steady else (makespan,)


def _slabs(m: int, size: int) -> list[tuple[int, int]]:
    """Windows of ``size`` consecutive microbatches: the cool-down's, the warm-up's, then the rest
    overlapping by half (where the heuristic's bubbles are first)."""
    if size >= m:
        return [(0, m)]
    out = [(m - size, m), (0, size)]
    step = max(1, size // 2)
    out += [(lo, lo + size) for lo in range(step, m - size, step)]
    return out


def _refine_by_slabs(prob, rows, best, first, steady, t0, time_limit, budget) -> Refined:
    """The ILP over one slab of microbatches at a time, the rest of the order fixed: the largest slab
    whose free pairs fit ``budget``, slabs visited in :func:`_slabs` order until a pass brings no gain
    or the time is spent; each solve gets a share of what is left."""
    p, m, costs, limit = prob.p, prob.m, prob.costs, prob.limit
    size = m
    while size > 2 and _open_pairs(prob, m - size, m) > budget:
        size = size * 3 // 4
    slabs = _slabs(m, size)
    solves, improved, gained = 0, False, True
    while gained:
        gained = False
        for n, slab in enumerate(slabs):
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0:
                break
            share = max(left / (len(slabs) - n), min(left, 1.0))
            found, _ = _solve(prob, rows, 3 * m, best[-1] + 1e-9, steady, share, slab)
            solves += 1
            score = None if found is None else _score(found, p, m, costs, limit, steady)
            if score is not None and score < tuple(x - 1e-9 for x in best):
                rows, best, improved, gained = found, score, True, True
    seconds = time.perf_counter() - t0
    return Refined(rows if improved else None, first, best, solves, seconds, size)


def refine(
    p: int,
    m: int,
    costs: ScheduleCosts,
    limit: int,
    start: Sequence[Sequence[Action]],
    *,
    time_limit: float,
    steady: bool = False,
    whole_pairs: int = WHOLE_PAIRS,
) -> Refined:
    """Refine the one-chunk order ``start`` (per-rank lists of F, I, W) under ``costs`` and at most
    ``limit`` microbatches in flight per rank, within ``time_limit`` seconds of solving (module
    docstring); ``steady`` scores by (span, makespan) as orders run with post-validation are."""
    t0 = time.perf_counter()
    rows = [list(r) for r in start]
    best = _score(rows, p, m, costs, limit, steady)
    first = best
    if not _in_kind_order(rows, m) or not math.isfinite(best[0]) or p < 2:
        return Refined(None, first, best, 0, 0.0, 0)
    prob = _Problem(p, m, costs, limit)
    floor_c, floor_s = _floors(prob, _bounds(prob, [], best[-1])[0])
    bound = floor_s if steady else floor_c
    if best[-1] <= floor_c + 1e-9 and (not steady or best[0] <= floor_s + 1e-9):
        return Refined(None, first, best, 0, time.perf_counter() - t0, 0, True, bound)  # optimal start
    whole = 3 * m
    if _open_pairs(prob) > whole_pairs:
        done = _refine_by_slabs(prob, rows, best, first, steady, t0, time_limit, SLAB_PAIRS)
        return replace(done, bound=bound)
    left = max(time_limit - (time.perf_counter() - t0), 0.01)
    found, proven = _solve(prob, rows, whole, best[-1] + 1e-9, steady, left)
    score = None if found is None else _score(found, p, m, costs, limit, steady)
    improved = score is not None and score < tuple(x - 1e-9 for x in best)
    if improved:
        rows, best = found, score
    seconds = time.perf_counter() - t0
    return Refined(rows if improved else None, first, best, 1, seconds, whole, proven, bound)
