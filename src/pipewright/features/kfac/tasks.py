"""A rank's K-FAC tasks of one refresh as a dependency graph, and the list scheduling that puts them
into the rank's bubbles iteration after iteration (the PipeFisher priorities, the 1.05 margin). Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

from pipewright.cost.base import CommModel
from pipewright.features.kfac.cost import TaskTimes, inversion_piece_weights, split_plan
from pipewright.features.kfac.gaps import EPS, Gap
from pipewright.features.kfac.kinds import (
    KFAC_A,
    KFAC_B,
    KFAC_INV_A,
    KFAC_INV_B,
    KFAC_REDUCE,
    Factor,
    Piece,
    factor_of,
)
from pipewright.ir import Action, F, I, Schedule

PRIORITY = {KFAC_A: 0, KFAC_B: 1, KFAC_REDUCE: 2, KFAC_INV_A: 3, KFAC_INV_B: 4}
FIT = 1.05  # PipeFisher's margin: a task goes into a bubble if 1.05 × its duration fits


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
class RefreshTask:
    """One K-FAC task of a refresh on a rank: its action, estimated duration, PipeFisher priority and
    dependencies; ``end`` is set once list scheduling places it."""

    action: Action
    duration: float
    priority: int
    deps: list[RefreshTask] = field(default_factory=list)
    ready_in_iteration: float | None = None  # curvature: the F/I end within each iteration
    refresh: int = 0
    end: float | None = None
    collective: float = 0.0  # reduction: collective time (runs on the collective stream)


def refresh_tasks(
    schedule: Schedule,
    rank: int,
    times: TaskTimes,
    ends: dict[tuple, float],
    comm: CommModel,
    split_limit: float | None,
    refresh: int,
    previous: list[RefreshTask] | None,
) -> tuple[list[RefreshTask], int]:
    """The tasks of one refresh on ``rank``; with ``split_limit``, inversions longer are split. Each
    factor has its own reduction, after its own curvature only (PipeFisher: ``sync_kron_A`` waits for the
    ``cov_kron_A`` only, ``inv_kron_A`` for both of A)."""
    tasks: list[RefreshTask] = []
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
                    t = RefreshTask(a, times.curv[s][layer][idx], PRIORITY[kind], ready_in_iteration=ends[ev])
                    t.refresh = refresh
                    before = prev_curv.get((kind, s, k, layer))
                    if before is not None:
                        t.deps.append(before)  # one accumulator slot: the previous refresh's first
                    curv.append(t)
            tasks += curv
            reductions = {}
            for factor, curv_kind in (("A", KFAC_A), ("B", KFAC_B)):
                inputs = [t for t in curv if t.action.kind == curv_kind]
                red = RefreshTask(
                    Action(s, KFAC_REDUCE, None, Factor(layer, factor)), 0.0, PRIORITY[KFAC_REDUCE]
                )
                red.deps, red.refresh = inputs, refresh
                red.collective = comm.collective_time(
                    "all_reduce", rank, times.factor_bytes(s, layer, factor)
                )
                reductions[factor] = red
                tasks.append(red)
            for kind, idx in ((KFAC_INV_A, 0), (KFAC_INV_B, 1)):
                whole = times.inv[s][layer][idx]
                sh = times.shapes[s][layer]
                m_dim = sh.dim_a if idx == 0 else sh.dim_b
                plan = None
                if split_limit is not None and whole * FIT > split_limit:
                    plan = split_plan(m_dim, whole, split_limit, FIT)
                dep = reductions[factor_of(kind)]
                if plan is None:
                    t = RefreshTask(
                        Action(s, kind, None, layer), whole, PRIORITY[kind], deps=[dep], refresh=refresh
                    )
                    tasks.append(t)
                    continue
                splits += 1
                for j, w in enumerate(inversion_piece_weights(m_dim, *plan)):
                    t = RefreshTask(
                        Action(s, kind, None, Piece(layer, j, *plan)),
                        whole * w,
                        PRIORITY[kind],
                        deps=[dep],
                        refresh=refresh,
                    )
                    tasks.append(t)
                    dep = t
    return tasks, splits


def _ready_at(t: RefreshTask, period: float) -> float:
    """When ``t`` can start: after its dependencies (a reduction's collective included); curvature at the
    first occurrence of its F/I at or after that (its tensors are kept until it runs)."""
    r = max((d.end + d.collective for d in t.deps), default=0.0)
    if t.ready_in_iteration is not None:
        e = t.ready_in_iteration
        r = max(0, math.ceil((r - e) / period - 1e-9)) * period + e
    return r


def list_schedule(
    tasks: list[RefreshTask], gaps: list[Gap], period: float, row_len: int, rank: int, max_iterations: int
) -> tuple[list[Placement], list[float]]:
    """Place ``tasks`` into ``gaps`` of successive iterations; returns placements and, per iteration,
    the serial time added after the rank's last action. Candidates are the tasks whose dependencies
    are placed (a counter per task), so each choice scans only those."""
    placements: list[Placement] = []
    extra: list[float] = []
    biggest = max((g.end - g.start for g in gaps), default=0.0)
    unmet = {id(t): len(t.deps) for t in tasks}
    children: dict[int, list[RefreshTask]] = {}
    for t in tasks:
        for d in t.deps:
            children.setdefault(id(d), []).append(t)
    ready: list[RefreshTask] = [t for t in tasks if not t.deps]
    left = len(tasks)

    ready_at = partial(_ready_at, period=period)

    def place(t: RefreshTask, it: int, start: float, pos: int, in_bubble: bool) -> None:
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

    def best_in(cursor: float, end: float | None) -> tuple[RefreshTask, float] | None:
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
