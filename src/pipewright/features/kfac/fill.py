"""The bubble-filling pass (PipeFisher, Osawa et al. MLSys 2023, generalised): put each rank's K-FAC
tasks into the idle gaps of a synchronous schedule.

1. Simulate the plain schedule once; each rank's idle gaps within one iteration (before its first
   compute, between computes, after its last compute until the iteration ends) are the bubbles.
2. Preconditioning of a stage (every step) goes right after the stage's last weight gradient, into the
   tail bubble (``precondition="tail"``, beyond the paper), or after the whole pipeline
   (``precondition="end"``, as in the paper: it then lengthens every step).
3. List scheduling, rank by rank, iteration after iteration: in every bubble, in time order, place the
   ready task of highest priority — curvature A (0), curvature B (1), factor reduction (2), inversion A
   (3), inversion B (4); ties by earliest start — whose 1.05 × duration fits in what is left of the
   bubble. Curvature of microbatch k needs that iteration's F (A) or I (B) of k; reduction needs all
   curvature of its layer; inversion needs the reduction. A refresh spans as many iterations as it takes:
   the refresh interval. A task longer than every bubble is split into pieces that fit (``split=True``,
   beyond the paper: a blocked Cholesky in column panels, then the inverse from the factor), or else
   runs after the rank's last action (it lengthens that iteration), as does whatever is left after
   ``max_iterations``.
4. Every iteration of the refresh becomes its own schedule with the tasks inserted after the action
   that ends before the bubble (after its sends, before any receive), and is simulated again: the
   iteration time with K-FAC, and the utilization before and after, come from the simulator.

Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.cost.unit import UnitCost
from pipewright.errors import PipewrightError
from pipewright.features.kfac.cost import KFACCost, TaskTimes, inversion_piece_weights, split_plan
from pipewright.features.kfac.kinds import (
    KFAC_A,
    KFAC_B,
    KFAC_FILL,
    KFAC_INV_A,
    KFAC_INV_B,
    KFAC_PRECOND,
    KFAC_REDUCE,
    Piece,
    with_kfac_kinds,
)
from pipewright.ir import Action, B, F, I, Schedule, W
from pipewright.passes.lower import lower
from pipewright.sim.engine import simulate

PRIORITY = {KFAC_A: 0, KFAC_B: 1, KFAC_REDUCE: 2, KFAC_INV_A: 3, KFAC_INV_B: 4}
FIT = 1.05  # PipeFisher's margin: a task goes into a bubble if 1.05 × its duration fits
EPS = 1e-12


class FillError(PipewrightError):
    """The schedule cannot be filled (e.g. it is asynchronous)."""


@dataclass(frozen=True)
class Gap:
    """An idle interval [start, end) of a rank in iteration 0; tasks go in before row index ``pos``."""

    start: float
    end: float
    pos: int


@dataclass(frozen=True)
class Placement:
    """Where one K-FAC task runs: ``iteration`` of the refresh, its start/end in the plain schedule's
    timeline (absolute: iteration k starts at k·T), the row index it is inserted before, and whether
    it sits in a bubble (False: it runs after the rank's last action and lengthens the iteration)."""

    rank: int
    action: Action
    iteration: int
    start: float
    end: float
    pos: int
    in_bubble: bool
    refresh: int = 0
    carried: bool = False  # curvature from an earlier iteration's saved tensors


@dataclass
class _Task:
    action: Action
    duration: float
    priority: int
    deps: list[_Task] = field(default_factory=list)
    ready_in_iteration: float | None = None  # curvature: the F/I end within each iteration
    refresh: int = 0
    end: float | None = None
    collective: float = 0.0  # reduction: collective time (runs on the collective stream)


@dataclass(frozen=True)
class FillResult:
    """The filled schedules of one refresh and what the pass measured.

    ``iterations``: one schedule per iteration of the refresh (tasks inserted, PRECOND every step).
    ``refresh_interval``: iterations one refresh takes (max over ranks). ``steady_iterations_per_refresh``:
    iterations per refresh when refreshes run back to back (fractional, the paper's quantity).
    ``utilization_before/after``: Σ compute / (ranks × time) of the plain iteration and over the filled
    iterations; ``iteration_time_before`` and ``iteration_times_after`` from the simulator.
    ``bubble_work``/``serial_work``: K-FAC refresh work placed in bubbles / after the last action."""

    base: Schedule
    iterations: tuple[Schedule, ...]
    placements: tuple[Placement, ...]
    refresh_interval: int
    steady_iterations_per_refresh: float
    iteration_time_before: float
    iteration_times_after: tuple[float, ...]
    utilization_before: float
    utilization_after: float
    bubble_work: float
    serial_work: float
    split_inversions: int
    cost: KFACCost | None = None
    comm: CommModel | None = None

    @property
    def fitted_fraction(self) -> float:
        total = self.bubble_work + self.serial_work
        return self.bubble_work / total if total > 0 else 1.0

    @property
    def step_time_ratio(self) -> float:
        """Mean filled iteration time over the plain one."""
        mean = sum(self.iteration_times_after) / len(self.iteration_times_after)
        return mean / self.iteration_time_before

    def summary(self) -> dict:
        return {
            "schedule": self.base.name,
            "refresh_interval": self.refresh_interval,
            "steady_iterations_per_refresh": self.steady_iterations_per_refresh,
            "iteration_time_before": self.iteration_time_before,
            "iteration_time_after_mean": sum(self.iteration_times_after) / len(self.iteration_times_after),
            "utilization_before": self.utilization_before,
            "utilization_after": self.utilization_after,
            "fitted_fraction": self.fitted_fraction,
            "split_inversions": self.split_inversions,
        }


def _skip_sends(row: tuple[Action, ...], pos: int, schedule: Schedule) -> int:
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
        pos = _skip_sends(row, i + 1, schedule)
    if period - t > EPS:
        gaps.append(Gap(t, period, len(row)))
    return gaps


def _event_ends(schedule: Schedule, sim, rank: int) -> dict[tuple, float]:
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


def _refresh_tasks(
    schedule: Schedule,
    rank: int,
    times: TaskTimes,
    ends: dict[tuple, float],
    comm: CommModel,
    split_limit: float | None,
    refresh: int,
    previous: list[_Task] | None,
) -> tuple[list[_Task], int]:
    """The tasks of one refresh on ``rank``; with ``split_limit``, inversions longer are split."""
    tasks: list[_Task] = []
    splits = 0
    m = schedule.num_microbatches
    prev_curv = {
        (t.action.kind, t.action.stage, t.action.microbatch, t.action.payload): t for t in previous or []
    }
    for s in schedule.stages_of(rank):
        for layer in range(times.layers(s)):
            curv = []
            for k in range(m):
                for kind, idx, ev in ((KFAC_A, 0, (F, s, k)), (KFAC_B, 1, (I, s, k))):
                    a = Action(s, kind, k, layer)
                    t = _Task(a, times.curv[s][layer][idx], PRIORITY[kind], ready_in_iteration=ends[ev])
                    t.refresh = refresh
                    before = prev_curv.get((kind, s, k, layer))
                    if before is not None:
                        t.deps.append(before)  # one accumulator slot: the previous refresh's first
                    curv.append(t)
            red = _Task(Action(s, KFAC_REDUCE, None, layer), 0.0, PRIORITY[KFAC_REDUCE], deps=list(curv))
            red.refresh = refresh
            red.collective = comm.collective_time("all_reduce", rank, times.factor_bytes(s, layer))
            tasks += [*curv, red]
            for kind, idx in ((KFAC_INV_A, 0), (KFAC_INV_B, 1)):
                whole = times.inv[s][layer][idx]
                sh = times.shapes[s][layer]
                m_dim = sh.dim_a if idx == 0 else sh.dim_b
                plan = None
                if split_limit is not None and whole * FIT > split_limit:
                    plan = split_plan(m_dim, whole, split_limit, FIT)
                dep = red
                if plan is None:
                    t = _Task(
                        Action(s, kind, None, layer), whole, PRIORITY[kind], deps=[dep], refresh=refresh
                    )
                    tasks.append(t)
                    continue
                splits += 1
                for j, w in enumerate(inversion_piece_weights(m_dim, *plan)):
                    t = _Task(
                        Action(s, kind, None, Piece(layer, j, *plan)),
                        whole * w,
                        PRIORITY[kind],
                        deps=[dep],
                        refresh=refresh,
                    )
                    tasks.append(t)
                    dep = t
    return tasks, splits


def _list_schedule(
    tasks: list[_Task], gaps: list[Gap], period: float, row_len: int, rank: int, max_iterations: int
) -> tuple[list[Placement], list[float]]:
    """Place ``tasks`` into ``gaps`` of successive iterations; returns placements and, per iteration,
    the serial time added after the rank's last action. Candidates are the tasks whose dependencies
    are placed (a counter per task), so each choice scans only those."""
    placements: list[Placement] = []
    extra: list[float] = []
    biggest = max((g.end - g.start for g in gaps), default=0.0)
    unmet = {id(t): len(t.deps) for t in tasks}
    children: dict[int, list[_Task]] = {}
    for t in tasks:
        for d in t.deps:
            children.setdefault(id(d), []).append(t)
    ready: list[_Task] = [t for t in tasks if not t.deps]
    left = len(tasks)

    def ready_at(t: _Task) -> float:
        r = max((d.end + d.collective for d in t.deps), default=0.0)
        if t.ready_in_iteration is not None:
            # the first occurrence of its F/I at or after r; its tensors are kept until it runs
            e = t.ready_in_iteration
            r = max(0, math.ceil((r - e) / period - 1e-9)) * period + e
        return r

    def place(t: _Task, it: int, start: float, pos: int, in_bubble: bool) -> None:
        nonlocal left
        t.end = start + t.duration
        e = t.ready_in_iteration
        carried = e is not None and start < it * period + e - EPS
        placements.append(Placement(rank, t.action, it, start, t.end, pos, in_bubble, t.refresh, carried))
        ready.remove(t)
        left -= 1
        for c in children.get(id(t), ()):
            unmet[id(c)] -= 1
            if unmet[id(c)] == 0:
                ready.append(c)
                if c.action.kind == KFAC_REDUCE:  # on the collective stream, right after its last input
                    place(c, it, ready_at(c), pos, True)

    def best_in(cursor: float, end: float | None) -> tuple[_Task, float] | None:
        best = None
        for t in ready:
            start = max(cursor, ready_at(t))
            if end is not None and start + FIT * t.duration > end + EPS:
                continue
            key = (t.refresh, t.priority, start)
            if best is None or key < best[0]:
                best = (key, t, start)
        return None if best is None else (best[1], best[2])

    it = 0
    while left and it < max_iterations:
        base = it * period
        for g in gaps:
            cursor, end = base + g.start, base + g.end
            while (hit := best_in(cursor, end)) is not None:
                t, start = hit
                place(t, it, start, g.pos, True)
                cursor = t.end
        # tasks that fit no bubble at all run after the rank's last action
        t_end = base + period
        added = 0.0
        while True:
            stuck = [t for t in ready if FIT * t.duration > biggest]
            if not stuck:
                break
            t = min(stuck, key=lambda t: (t.refresh, t.priority))
            place(t, it, max(t_end + added, ready_at(t)), row_len, False)
            added = t.end - t_end
        extra.append(added)
        it += 1
    if left:  # whatever is left runs after the last iteration's actions, in dependency order
        it = max_iterations - 1
        t_end = (it + 1) * period + extra[-1]
        while left:
            t, start = best_in(t_end, None)
            place(t, it, start, row_len, False)
            t_end = max(t_end, t.end)
        extra[-1] = t_end - (it + 1) * period
    return placements, extra


def _with_tasks(
    schedule: Schedule,
    inserts: dict[int, list[tuple[int, int, Action]]],
    prior: frozenset,
    carried: frozenset,
    name: str,
) -> Schedule:
    rows = []
    for rank, row in enumerate(schedule.actions):
        extra = sorted(inserts.get(rank, []))
        out: list[Action] = []
        j = 0
        for pos in range(len(row) + 1):
            while j < len(extra) and extra[j][0] == pos:
                out.append(extra[j][2])
                j += 1
            if pos < len(row):
                out.append(row[pos])
        rows.append(out)
    meta = {**schedule.meta, "kfac_prior": prior, "kfac_carried": carried}
    return schedule.with_actions(rows, name=name, meta=meta)


def _precond_inserts(
    schedule: Schedule, sim, times: TaskTimes, mode: str
) -> tuple[dict[int, list[tuple[int, int, Action]]], dict[int, list[tuple[float, float]]]]:
    """PRECOND per stage after its last W ("tail") or before the rank's STEP after all ("end");
    returns the inserts and, per rank, the (start, duration) it takes out of the bubbles."""
    inserts: dict[int, list[tuple[int, int, Action]]] = {}
    used: dict[int, list[tuple[float, float]]] = {}
    for rank, row in enumerate(schedule.actions):
        spans = sim.spans_of(rank)
        for s in schedule.stages_of(rank):
            last = max(i for i, a in enumerate(row) if a.stage == s and a.kind in (B, W))
            act = Action(s, KFAC_PRECOND)
            if mode == "tail":
                pos = _skip_sends(row, last + 1, schedule)
                inserts.setdefault(rank, []).append((pos, -1, act))
                used.setdefault(rank, []).append((spans[last][2], times.prec[s]))
            else:
                steps = [i for i, a in enumerate(row) if a.kind == "STEP" and a.stage == s]
                pos = steps[0] if steps else len(row)
                inserts.setdefault(rank, []).append((pos, -1, act))
    return inserts, used


def _take(gaps: list[Gap], uses: Iterable[tuple[float, float]]) -> list[Gap]:
    """Remove preconditioning time from the gap that begins when it starts."""
    out = list(gaps)
    for start, dur in uses:
        for i, g in enumerate(out):
            if g.start >= start - 1e-9 and g.start - start <= 1e-9 + 0.0:
                out[i] = Gap(min(g.end, g.start + dur), g.end, g.pos)
                break
    return [g for g in out if g.end - g.start > EPS]


def fill_kfac(
    schedule: Schedule,
    cost: CostModel,
    times: TaskTimes,
    *,
    comm: CommModel | None = None,
    precondition: str = "tail",
    split: bool = True,
    max_iterations: int = 64,
    steady_refreshes: int = 6,
) -> FillResult:
    """Fill ``schedule``'s bubbles with one K-FAC refresh (see the module docstring)."""
    if not schedule.meta.get("flush", True):
        raise FillError(f"{schedule.name}: bubble filling needs a synchronous schedule (one with a flush)")
    if precondition not in ("tail", "end"):
        raise FillError(f"--precondition must be 'tail' or 'end' (got {precondition!r})")
    comm = comm or FreeComm()
    base = lower(schedule)
    base = base.with_actions(base.actions, kinds=with_kfac_kinds(base.kinds))
    full_cost = KFACCost(cost, times)
    plain = simulate(base, full_cost, comm=comm)
    period = plain.iteration_time
    pre_inserts, pre_used = _precond_inserts(base, plain, times, precondition)
    per_rank: dict[int, list[Placement]] = {}
    extra_by_rank: dict[int, list[float]] = {}
    steady: list[float] = []
    splits = 0
    for rank in range(base.num_ranks):
        gaps = _take(rank_gaps(base, plain, rank, period), pre_used.get(rank, ()))
        limit = max((g.end - g.start for g in gaps), default=0.0) if split else None
        ends = _event_ends(base, plain, rank)
        row_len = len(base.actions[rank])
        tasks, n_split = _refresh_tasks(base, rank, times, ends, comm, limit, 0, None)
        splits += n_split
        placed, extra = _list_schedule(tasks, gaps, period, row_len, rank, max_iterations)
        per_rank[rank] = placed
        extra_by_rank[rank] = extra
        # back-to-back refreshes: the steady-state iterations per refresh
        many: list[_Task] = []
        prev = None
        for r in range(steady_refreshes):
            ts, _ = _refresh_tasks(base, rank, times, ends, comm, limit, r, prev)
            many += ts
            prev = ts
        placed_many, _ = _list_schedule(many, gaps, period, row_len, rank, max_iterations * steady_refreshes)
        done = [max(p.end for p in placed_many if p.refresh == r) for r in range(steady_refreshes)]
        if steady_refreshes > 1:
            steady.append((done[-1] - done[0]) / (steady_refreshes - 1) / period)
        else:
            steady.append(done[0] / period)
    n_iter = max(max(p.iteration for p in ps) + 1 for ps in per_rank.values())
    iterations = []
    prior: set = set()
    for it in range(n_iter):
        inserts = {r: list(v) for r, v in pre_inserts.items()}
        for rank, ps in per_rank.items():
            for order, p in enumerate(sorted(ps, key=lambda p: p.start)):
                if p.iteration == it:
                    inserts.setdefault(rank, []).append((p.pos, order, p.action))
        carried = frozenset(
            (p.action.kind, p.action.stage, p.action.microbatch, p.action.payload)
            for ps in per_rank.values()
            for p in ps
            if p.iteration == it and p.carried
        )
        iterations.append(_with_tasks(base, inserts, frozenset(prior), carried, f"{base.name}+kfac[{it}]"))
        prior |= {
            (p.action.kind, p.action.stage, p.action.microbatch, p.action.payload)
            for ps in per_rank.values()
            for p in ps
            if p.iteration == it
        }
    sims = [simulate(s, full_cost, comm=comm) for s in iterations]
    times_after = tuple(s.iteration_time for s in sims)
    ranks = base.num_ranks
    util_before = sum(plain.busy) / (ranks * period)
    util_after = sum(sum(s.busy) for s in sims) / (ranks * sum(times_after))
    placements = tuple(p for ps in per_rank.values() for p in ps)
    bubble = sum(p.end - p.start for p in placements if p.in_bubble)
    serial = sum(p.end - p.start for p in placements if not p.in_bubble)
    return FillResult(
        base=base,
        iterations=tuple(iterations),
        placements=placements,
        refresh_interval=n_iter,
        steady_iterations_per_refresh=max(steady),
        iteration_time_before=period,
        iteration_times_after=times_after,
        utilization_before=util_before,
        utilization_after=util_after,
        bubble_work=bubble,
        serial_work=serial,
        split_inversions=splits,
        cost=full_cost,
        comm=comm,
    )


def slot_schedule(schedule: Schedule, *, precondition: bool = True) -> tuple[Schedule, dict[tuple, float]]:
    """``schedule`` lowered, with a ``KFAC_FILL`` at every predicted bubble (payload: its index on the
    rank) and a ``KFAC_PRECOND`` after each stage's last W; returns it and each bubble's length in
    unit costs, keyed by (stage, index)."""
    base = lower(schedule)
    base = base.with_actions(base.actions, kinds=with_kfac_kinds(base.kinds))
    sim = simulate(base, UnitCost())
    inserts: dict[int, list[tuple[int, int, Action]]] = {}
    budgets: dict[tuple, float] = {}
    for rank, row in enumerate(base.actions):
        first = base.stages_of(rank)[0]
        for j, g in enumerate(rank_gaps(base, sim, rank, sim.iteration_time)):
            inserts.setdefault(rank, []).append((g.pos, 1, Action(first, KFAC_FILL, None, j)))
            budgets[(first, j)] = g.end - g.start
        if precondition:
            for s in base.stages_of(rank):
                last = max(i for i, a in enumerate(row) if a.stage == s and a.kind in (B, W))
                inserts.setdefault(rank, []).append(
                    (_skip_sends(row, last + 1, base), 0, Action(s, KFAC_PRECOND))
                )
    return _with_tasks(base, inserts, frozenset(), frozenset(), base.name + "+kfac"), budgets
