"""K-FAC in the bubbles of a running pipeline: ``pipewright train --optimizer kfac``.

The schedule gets, per rank, one ``KFAC_FILL(s, j)`` action at each bubble j the simulator predicts
(unit costs F = 1, B = 2, I = W = 1; :func:`slot_schedule`) and one ``KFAC_PRECOND(s)`` right after
stage s's last weight gradient (its tail bubble). Handlers (passed to the executor with
``handlers=``, nothing hard-wired):

- F: while a refresh records, the hooks save each covered layer's input and output gradient for that
  microbatch (the first iteration of a refresh records all m microbatches);
- ``KFAC_FILL``: runs pending tasks — curvature A, then B, then factor reduction, then inversion
  pieces (blocked Cholesky, :class:`~.factors.PiecewiseInverse`) — in that priority, each only if
  1.05 × its measured duration fits in what is left of the bubble's predicted length (bubble units ×
  the measured duration of one F on this rank); a refresh continues in the next iterations' bubbles;
- ``KFAC_PRECOND``: preconditions the stage's gradients (dp = 1; with dp > 1 after the gradient
  all-reduce, at the optimizer step);
- RECV_F/RECV_B (``opportunistic=True``): while the receive has not completed, runs pending tasks.
  Gloo cannot be polled (``is_completed()`` stays False until ``wait()``, and a ``wait(timeout)`` that
  times out closes the connection), so a helper thread waits on the receive and the rank computes
  K-FAC tasks until it is done.

With dp > 1 the factor all-reduce must happen at the same point on every replica, so it runs at the
optimizer step after the recording iteration (any curvature left over runs there first).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from pipewright.features.kfac.factors import PiecewiseInverse
from pipewright.features.kfac.fill import FIT, slot_schedule
from pipewright.features.kfac.kfac import KFAC, KFACConfig, covered_layers
from pipewright.features.kfac.kinds import KFAC_FILL, KFAC_PRECOND
from pipewright.features.kfac.optimizer import KFACOptimizer
from pipewright.ir import RECV_B, RECV_F, Action, F, Schedule

PANEL = 256  # rows per Cholesky panel of a split inversion


@dataclass
class BubbleWorker:
    """This rank's K-FAC refresh as a queue of tasks run a few at a time, in PipeFisher's priority."""

    kfac: KFAC
    stage_of_layer: list[int]
    microbatches: int
    dp: int = 1
    recording: bool = True
    estimates: dict[tuple, float] = field(default_factory=dict)
    jobs: dict[tuple[int, str], PiecewiseInverse] = field(default_factory=dict)
    reduced: set[int] = field(default_factory=set)
    refreshes: int = 0
    tasks_run: int = 0
    waits_filled: int = 0  # receives that ran tasks while waiting (opportunistic mode)
    unit_s: float | None = None  # measured duration of one F (a unit of the predicted bubbles)
    fill_scale: float = 1.0  # fraction of each predicted bubble the tasks may use
    min_interval: int = 1  # iterations between the starts of two refreshes (K-FAC's inverse interval)
    _started: int = 0  # iteration the current refresh started recording
    _iteration: int = -1
    _recorded: bool = False
    _start_next: bool = False

    # -- iteration boundaries ------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        if iteration == self._iteration:
            return
        self._iteration = iteration
        if self._recorded:
            self.recording = False  # one iteration's microbatches per refresh
        self._recorded = False
        if self._start_next and iteration - self._started >= self.min_interval:
            # a refresh finished and the inverse interval has passed: record this iteration
            self.recording, self._start_next = True, False
        if self.recording:
            self._started = iteration

    def forward(self, k: int) -> None:
        self.kfac.microbatch = k if self.recording else None
        if self.recording:
            self._recorded = True

    # -- the task queue ------------------------------------------------------------------------
    def _next(self) -> list[tuple[tuple, Callable[[], None]]]:
        """Runnable tasks, highest priority first."""
        kfac, out = self.kfac, []
        for which in ("A", "B"):
            for w, i, k in kfac.pending():
                if w == which:
                    fn = kfac.curvature_a if which == "A" else kfac.curvature_b
                    out.append(((which, i), lambda fn=fn, i=i, k=k: fn(i, k)))
        if self.dp == 1 and not self.recording:
            for i, st in enumerate(kfac.layers):
                if i not in self.reduced and st.a_count == self.microbatches == st.b_count:
                    out.append((("R", i), lambda i=i: self._reduce(i)))
        for (i, which), job in self.jobs.items():
            out.append((("I" + which, i, job.index), lambda i=i, which=which: self._invert_piece(i, which)))
        return out

    def _reduce(self, i: int) -> None:
        kfac = self.kfac
        kfac.reduce_factors(i)
        self.reduced.add(i)
        st, root = kfac.layers[i], kfac.config.damping**0.5
        for which, m, shift in (("A", st.a, st.pi * root), ("B", st.b, root / st.pi)):
            self.jobs[(i, which)] = PiecewiseInverse(m, shift, max(1, math.ceil(m.shape[0] / PANEL)))

    def _invert_piece(self, i: int, which: str) -> None:
        job = self.jobs[(i, which)]
        job.step()
        if job.done:
            st = self.kfac.layers[i]
            if which == "A":
                st.a_inv = job.result
            else:
                st.b_inv = job.result
            del self.jobs[(i, which)]
            if len(self.reduced) == len(self.kfac.layers) and not self.jobs:
                self.refreshes += 1
                self.reduced.clear()
                self._start_next = True  # the next iteration starts the next refresh

    def run_one(self, budget_s: float | None) -> bool:
        """Run the highest-priority task whose estimate fits ``budget_s`` (None: any); False if none."""
        for key, fn in self._next():
            est = self.estimates.get(key, 0.0)
            if budget_s is not None and FIT * est > budget_s:
                continue
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            self.estimates[key] = dt if key not in self.estimates else 0.5 * (self.estimates[key] + dt)
            self.tasks_run += 1
            return True
        return False

    def fill(self, budget_s: float) -> None:
        """Run tasks while they fit in ``budget_s`` seconds."""
        end = time.perf_counter() + budget_s
        while (left := end - time.perf_counter()) > 0 and self.run_one(left):
            pass

    def drain(self) -> None:
        """Run every pending task now (used at the step with dp > 1, and by tests)."""
        while self.run_one(None):
            pass

    def step_sync(self) -> None:
        """dp > 1: after the recording iteration, finish its curvature and all-reduce every factor
        (the same point on every replica), then the inversions continue in the bubbles."""
        if self.dp == 1 or self.recording or self.reduced:
            return
        kfac = self.kfac
        if not any(st.a_count for st in kfac.layers) and not kfac.pending():
            return
        kfac.run_pending_curvature()
        for i in range(len(kfac.layers)):
            self._reduce(i)


class PipelinedKFAC(KFACOptimizer):
    """The optimizer of ``--optimizer kfac``: the bubbles do the refresh; the step preconditions what the
    tail bubbles did not, KL-clips, and runs the base update."""

    def __init__(self, kfac: KFAC, base: torch.optim.Optimizer, worker: BubbleWorker) -> None:
        super().__init__(kfac, base)
        self.worker = worker

    @torch.no_grad()
    def step(self) -> float:
        self.worker.step_sync()
        for i, st in enumerate(self.kfac.layers):
            if st.preconditioned is None or self.worker.dp > 1:
                self.kfac.precondition(i)
        nu = self.kfac.apply(self.base.param_groups[0]["lr"])
        self.base.step()
        self.steps += 1
        return nu


def kfac_handlers(
    worker: BubbleWorker, budgets: dict[tuple, float], *, opportunistic: bool = False
) -> dict[str, Callable]:
    """Executor handlers: F records, KFAC_FILL fills a bubble, KFAC_PRECOND preconditions, and with
    ``opportunistic`` the receives run tasks while they wait."""
    from pipewright.runtime.executor import default_handlers

    core = default_handlers()
    layers_of: dict[int, list[int]] = {}
    for i, s in enumerate(worker.stage_of_layer):
        layers_of.setdefault(s, []).append(i)
    f_time: list[float] = []

    def forward(state, a: Action) -> None:
        worker.begin_iteration(state.executor.iteration)
        worker.forward(a.microbatch)
        t0 = time.perf_counter()
        try:
            core[F](state, a)
        finally:
            worker.kfac.microbatch = None
        f_time.append(time.perf_counter() - t0)
        if len(f_time) >= 4:
            worker.unit_s = sorted(f_time)[len(f_time) // 2]
            del f_time[:-16]

    def fill(state, a: Action) -> None:
        worker.begin_iteration(state.executor.iteration)
        if worker.unit_s is not None:
            worker.fill(budgets[(a.stage, a.payload)] * worker.unit_s * worker.fill_scale)

    def precondition(state, a: Action) -> None:
        if worker.dp == 1:
            with torch.no_grad():
                for i in layers_of.get(a.stage, ()):
                    worker.kfac.precondition(i)

    out = {F: forward, KFAC_FILL: fill, KFAC_PRECOND: precondition}
    if opportunistic:

        def recv(state, a: Action) -> None:
            comm = state.comm
            if a not in comm._recvs:
                comm.post([a])
            work, buf = comm._recvs[a]
            if comm.scatter_gather or not worker._next() or work.is_completed():
                state.received[a] = comm.wait_recv(a)  # the core receive
                return
            # A gloo receive may be waited once only (a second wait() waits for another message), so
            # the helper thread's wait is the wait: the tensor is taken from the channel here.
            done, failed = threading.Event(), []

            def wait() -> None:
                try:
                    work.wait(timedelta(seconds=comm.timeout_s))
                except Exception as e:  # re-raised in the rank's thread
                    failed.append(e)
                finally:
                    done.set()

            helper = threading.Thread(target=wait, daemon=True)
            helper.start()
            worker.waits_filled += 1
            while not done.is_set() and worker.run_one(None):
                pass
            helper.join()
            comm._recvs.pop(a)
            if failed:
                raise failed[0]
            state.received[a] = buf

        out[RECV_F] = recv
        out[RECV_B] = recv
    return out


def attach_kfac(
    stages: dict[int, nn.Module],
    schedule: Schedule,
    base: torch.optim.Optimizer,
    *,
    dp_group=None,
    dp: int = 1,
    config: KFACConfig | None = None,
    grad_scale: float = 1.0,
    opportunistic: bool = False,
) -> tuple[PipelinedKFAC, dict[str, Callable], Schedule]:
    """K-FAC over the covered linears of this rank's ``stages`` (not the output layer): the optimizer,
    the executor handlers and the schedule with bubble and preconditioning actions."""
    layers, stage_of = [], []
    for s, mod in sorted(stages.items()):
        for name, m in covered_layers(mod):
            layers.append((f"{s}.{name}", m))
            stage_of.append(s)
    kfac = KFAC(layers, config, grad_scale=grad_scale, dp_group=dp_group)
    worker = BubbleWorker(
        kfac, stage_of, schedule.num_microbatches, dp=dp, min_interval=kfac.config.inv_interval
    )
    sched, budgets = slot_schedule(schedule)
    handlers = kfac_handlers(worker, budgets, opportunistic=opportunistic)
    return PipelinedKFAC(kfac, base, worker), handlers, sched


def attach_to_trainer(trainer) -> tuple[PipelinedKFAC, dict[str, Callable], Schedule]:
    """``--optimizer kfac`` (the feature's ``optimizers`` hook): K-FAC over ``trainer``'s stages with
    its AdamW as the base update; ``--kfac-opportunistic`` also runs pending tasks while a receive
    waits."""
    from pipewright.errors import ConfigError

    if trainer.master is not None:
        raise ConfigError("--optimizer kfac runs with --precision fp32 (no master weights yet)")
    c, mesh = trainer.config, trainer.mesh
    return attach_kfac(
        trainer.stages,
        trainer.schedule,
        trainer.optimizer,
        dp_group=mesh.dp_group,
        dp=mesh.dp,
        grad_scale=float(trainer.schedule.num_microbatches * c.microbatch_size * trainer.boundary_shape[1]),
        opportunistic=c.kfac_opportunistic,
    )


def parts(context):
    """The feature bundle's runtime factory: ``context`` has ``worker`` (a :class:`BubbleWorker`),
    ``budgets`` (from :func:`~.fill.slot_schedule`) and optionally ``opportunistic``."""
    from pipewright.features import RuntimeParts

    handlers = kfac_handlers(
        context.worker, context.budgets, opportunistic=getattr(context, "opportunistic", False)
    )
    return RuntimeParts(handlers=handlers)
