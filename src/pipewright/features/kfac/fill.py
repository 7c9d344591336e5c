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

from dataclasses import dataclass

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.cost.unit import UnitCost
from pipewright.errors import PipewrightError
from pipewright.features.kfac.cost import KFACCost, TaskTimes
from pipewright.features.kfac.gaps import Gap, event_ends, rank_gaps, skip_sends, take
from pipewright.features.kfac.kinds import KFAC_FILL, KFAC_PRECOND, with_kfac_kinds
from pipewright.features.kfac.pipefisher_plan import plan_iterations
from pipewright.features.kfac.tasks import FIT, Placement, RefreshTask, list_schedule, refresh_tasks
from pipewright.ir import Action, B, Schedule, W
from pipewright.passes.lower import lower
from pipewright.sim.engine import simulate

__all__ = ["FIT", "FillError", "FillResult", "Placement", "fill_kfac", "slot_schedule"]


class FillError(PipewrightError):
    """The schedule cannot be filled (e.g. it is asynchronous)."""


@dataclass(frozen=True)
class FillResult:
    """The filled schedules of one refresh and what the pass measured.

    ``iterations``: one schedule per iteration of the refresh (tasks inserted, PRECOND every step).
    ``refresh_interval``: iterations one refresh takes (max over ranks). ``steady_iterations_per_refresh``:
    iterations per refresh when refreshes run back to back (fractional, the paper's quantity).
    ``utilization_before/after``: Σ compute / (ranks × time) of the plain iteration and over the filled
    iterations; ``iteration_time_before`` and ``iteration_times_after`` from the simulator.
    ``bubble_work``/``serial_work``: K-FAC refresh work placed in bubbles / after the last action.
    ``pipefisher_plan_iterations``: PipeFisher's own "iterations per refresh", the period of its
    automatic plan (:mod:`pipewright.features.kfac.pipefisher_plan`; max over ranks)."""

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
    pipefisher_plan_iterations: int = 0

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
            "pipefisher_plan_iterations": self.pipefisher_plan_iterations,
        }


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
                pos = skip_sends(row, last + 1, schedule)
                inserts.setdefault(rank, []).append((pos, -1, act))
                used.setdefault(rank, []).append((spans[last][2], times.prec[s]))
            else:
                steps = [i for i, a in enumerate(row) if a.kind == "STEP" and a.stage == s]
                pos = steps[0] if steps else len(row)
                inserts.setdefault(rank, []).append((pos, -1, act))
    return inserts, used


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
    steady: list[float] = []
    splits = 0
    for rank in range(base.num_ranks):
        gaps = take(rank_gaps(base, plain, rank, period), pre_used.get(rank, ()))
        limit = max((g.end - g.start for g in gaps), default=0.0) if split else None
        ends = event_ends(base, plain, rank)
        tasks, n_split = refresh_tasks(base, rank, times, ends, comm, limit, 0, None)
        splits += n_split
        per_rank[rank], _ = list_schedule(tasks, gaps, period, len(base.actions[rank]), rank, max_iterations)
        steady.append(
            _steady_per_refresh(
                base, rank, times, comm, ends, gaps, limit, period, max_iterations, steady_refreshes
            )
        )
    iterations = _filled_iterations(base, per_rank, pre_inserts)
    n_iter = len(iterations)
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
        pipefisher_plan_iterations=max(
            plan_iterations(base, plain, r, times, _reduce_time(comm, times, r))
            for r in range(base.num_ranks)
        ),
    )


def _steady_per_refresh(
    base: Schedule,
    rank: int,
    times: TaskTimes,
    comm: CommModel,
    ends: dict[tuple, float],
    gaps: list[Gap],
    limit: float | None,
    period: float,
    max_iterations: int,
    refreshes: int,
) -> float:
    """Iterations per refresh on ``rank`` when ``refreshes`` refreshes run back to back (fractional):
    the spacing of their completions, over the plain iteration time."""
    many: list[RefreshTask] = []
    prev = None
    for r in range(refreshes):
        ts, _ = refresh_tasks(base, rank, times, ends, comm, limit, r, prev)
        many += ts
        prev = ts
    placed, _ = list_schedule(many, gaps, period, len(base.actions[rank]), rank, max_iterations * refreshes)
    done = [max(p.end for p in placed if p.refresh == r) for r in range(refreshes)]
    if refreshes > 1:
        return (done[-1] - done[0]) / (refreshes - 1) / period
    return done[0] / period


def _filled_iterations(
    base: Schedule,
    per_rank: dict[int, list[Placement]],
    pre_inserts: dict[int, list[tuple[int, int, Action]]],
) -> list[Schedule]:
    """One schedule per iteration of the refresh: ``base`` with that iteration's placed tasks and the
    preconditioning inserted; its meta names the tasks run in earlier iterations and the carried ones."""
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
            _task_key(p) for ps in per_rank.values() for p in ps if p.iteration == it and p.carried
        )
        iterations.append(_with_tasks(base, inserts, frozenset(prior), carried, f"{base.name}+kfac[{it}]"))
        prior |= {_task_key(p) for ps in per_rank.values() for p in ps if p.iteration == it}
    return iterations


def _task_key(p: Placement) -> tuple:
    return (p.action.kind, p.action.stage, p.action.microbatch, p.action.payload)


def _reduce_time(comm: CommModel, times: TaskTimes, rank: int):
    return lambda s, layer, factor: comm.collective_time(
        "all_reduce", rank, times.factor_bytes(s, layer, factor)
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
                    (skip_sends(row, last + 1, base), 0, Action(s, KFAC_PRECOND))
                )
    return _with_tasks(base, inserts, frozenset(), frozenset(), base.name + "+kfac"), budgets
