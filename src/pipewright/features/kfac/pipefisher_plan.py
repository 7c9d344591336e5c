"""PipeFisher's own "iterations per refresh": how many pipeline iterations its automatic work plan spans
(Osawa, Li, Hoefler, PipeFisher, MLSys 2023; the plan its ``auto_schedule.py`` builds from a profiled
timeline). The plan then repeats, so this is its period — an integer per rank, unlike the steady-state
figure of :func:`pipewright.features.kfac.fill.fill_kfac` (refreshes back to back, fractional).

Per rank, from one simulated iteration (its F, B, I and W spans; the bubbles are the gaps between them,
from the iteration's start to its end) and the rank's K-FAC tasks in PipeFisher's order — curvature A,
curvature B (each a queue of m per-microbatch pieces), reduction A, reduction B, inversion A, inversion B;
within a kind layer by layer:

1. fill the first iteration's bubbles in time order: in each bubble, over and over, take the first task
   in that order that fits with 1.05 × its duration (strictly less than what is left) and may run:
   curvature A of microbatch k once k forwards have run in this iteration (B: k backwards); a reduction
   once no curvature of its factor is left (any layer); an inversion once neither curvature nor
   reduction of its factor is left;
2. while tasks are left: if they all fit into the bubbles of the iterations planned so far (now with
   every curvature free to run: its inputs are kept from the previous repetition of the plan), the plan
   is complete; otherwise add one more iteration and fill it as in 1 (curvature free); if that iteration
   takes nothing, the rest runs after it.

The answer is the number of iterations in the plan. Pure Python.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pipewright.features.kfac.cost import TaskTimes
from pipewright.features.kfac.tasks import FIT
from pipewright.ir import B, F, I, Schedule, W

ReduceTime = Callable[[int, int, str], float]

#: PipeFisher's task order (``ngd_events``): curvature A, B, their reductions, their inversions
ORDER = ("cov_A", "cov_B", "sync_A", "sync_B", "inv_A", "inv_B")


@dataclass
class _Task:
    label: str  # one of ORDER
    duration: float  # of one piece for a curvature queue
    pieces: int = 1  # curvature: m pieces, one per microbatch
    taken: int = 0

    @property
    def left(self) -> int:
        return self.pieces - self.taken


def _tasks(schedule: Schedule, rank: int, times: TaskTimes, reduce_time: ReduceTime) -> list[_Task]:
    m = schedule.num_microbatches
    tasks = []
    for label in ORDER:
        idx = 0 if label.endswith("A") else 1
        for s in schedule.stages_of(rank):
            for layer in range(times.layers(s)):
                if label.startswith("cov"):
                    tasks.append(_Task(label, times.curv[s][layer][idx], m))
                elif label.startswith("sync"):
                    tasks.append(_Task(label, reduce_time(s, layer, label[-1])))
                else:
                    tasks.append(_Task(label, times.inv[s][layer][idx]))
    return tasks


def _may_run(task: _Task, tasks: list[_Task], forwards: int, backwards: int) -> bool:
    factor = task.label[-1]
    if task.label.startswith("cov"):
        return (forwards if factor == "A" else backwards) >= task.taken + 1
    blockers = ("cov_" + factor,) if task.label.startswith("sync") else ("cov_" + factor, "sync_" + factor)
    return not any(t.left and t.label in blockers for t in tasks)


Busy = list[tuple[float, float, str]]


def _fill(tasks: list[_Task], busy: Busy, period: float, gated: bool) -> Busy:
    """Step 1 over one iteration whose rank is ``busy`` (start, end, kind); returns what it placed."""
    placed: Busy = []
    forwards = backwards = 0
    edges = [(0.0, 0.0, ""), *sorted(busy), (period, period, "")]
    for (_, end, kind), (start, _, _) in itertools.pairwise(edges):
        forwards += kind == F
        backwards += kind in (B, I)
        cursor = end
        added = True
        while added:
            added = False
            for t in tasks:
                while t.left and cursor + FIT * t.duration < start:
                    open_gate = (10**9, 10**9) if not gated else (forwards, backwards)
                    if not _may_run(t, tasks, *open_gate):
                        break
                    t.taken += 1
                    placed.append((cursor, cursor + t.duration, ""))
                    cursor += t.duration
                    added = True
    return placed


def plan_iterations(
    schedule: Schedule, sim, rank: int, times: TaskTimes, reduce_time: ReduceTime | None = None
) -> int:
    """Iterations of PipeFisher's plan on ``rank`` (module docstring); ``sim`` simulates ``schedule``
    (lowered); ``reduce_time(stage, layer, factor)`` is a factor reduction's time, which PipeFisher runs
    in the bubbles like the other tasks (default 0: one data-parallel replica)."""
    reduce_time = reduce_time or (lambda s, layer, factor: 0.0)
    busy = [(s, e, a.kind) for a, s, e in sim.spans_of(rank) if a.kind in (F, B, I, W)]
    period = sim.iteration_time
    tasks = _tasks(schedule, rank, times, reduce_time)
    plan = [busy + _fill(tasks, busy, period, gated=True)]
    while any(t.left for t in tasks):
        trial = [_Task(t.label, t.duration, t.pieces, t.taken) for t in tasks]
        for occupied in plan:
            _fill(trial, occupied, period, gated=False)
        if not any(t.left for t in trial):
            break
        placed = _fill(tasks, busy, period, gated=False)
        plan.append(busy + placed)
        if not placed:
            break  # nothing fits a fresh iteration: the rest runs after it
    return len(plan)
