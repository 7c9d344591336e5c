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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipewright.features.kfac.factors import PiecewiseInverse
from pipewright.features.kfac.fill import FIT, slot_schedule
from pipewright.features.kfac.kfac import KFAC, KFACConfig, covered_layers
from pipewright.features.kfac.kinds import KFAC_FILL, KFAC_PRECOND
from pipewright.features.kfac.optimizer import KFACOptimizer
from pipewright.features.kfac.state import StateNames, layout_name, load_state, save_state, wanted_keys
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
    fill_scale: float = 1.0  # fraction of each predicted bubble the tasks may use (inf: all pending tasks)
    min_interval: int = 1  # iterations between the starts of two refreshes (K-FAC's inverse interval)
    has_bubbles: bool = True  # False: no bubble on this rank (e.g. pp = 1): the tasks run at the step
    staged: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # dp > 1: inverses to install
    planned: dict[tuple, tuple] | None = None  # (stage, bubble) → curvature tasks (.memory.plan_fills)
    iterations: int = 0  # iterations begun (the counter of the refresh interval)
    _started: int = 0  # iteration (count) the current refresh started recording
    _iteration: int = -1  # the executor's number of the current iteration
    _recorded: bool = False
    _start_next: bool = False
    _stepped: bool = False  # the current iteration's optimizer step ran

    # -- iteration boundaries ------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        if iteration == self._iteration:
            return
        self._iteration = iteration
        self.iterations += 1
        if self._recorded and not self._stepped:
            # the recording iteration's optimizer step did not run (fp16 overflow, a skipped non-finite
            # step): its curvature is discarded and this iteration records again
            self.kfac.discard_recording()
            self._recorded = False
        if self._recorded:
            self.recording = False  # one iteration's microbatches per refresh
        self._recorded = self._stepped = False
        if self._start_next and self.iterations - self._started >= self.min_interval:
            # a refresh finished and the inverse interval has passed: record this iteration
            self.recording, self._start_next = True, False
        if self.recording:
            self._started = self.iterations

    def stepped(self) -> None:
        """The optimizer step of the current iteration runs (its recorded curvature counts)."""
        self._stepped = True

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
            self.staged[(i, which)] = job.result
            del self.jobs[(i, which)]
            if self.dp == 1:  # with dp > 1 the replicas install at one step (install_agreed)
                self._install()

    def _install(self) -> None:
        """Put the finished inverses in use; once the whole refresh is in, the next may start."""
        for (i, which), inv in self.staged.items():
            st = self.kfac.layers[i]
            if which == "A":
                st.a_inv = inv
            else:
                st.b_inv = inv
        self.staged.clear()
        if len(self.reduced) == len(self.kfac.layers) and not self.jobs:
            self.refreshes += 1
            self.reduced.clear()
            self._start_next = True  # the next iteration starts the next refresh

    def install_agreed(self) -> None:
        """dp > 1, at the optimizer step: install the refresh's inverses once every replica has all of
        them (one MIN all-reduce of a flag, only while a refresh is being inverted), so the replicas
        always precondition with the same inverses and stay identical."""
        if self.dp == 1 or not self.reduced:
            return
        done = torch.tensor([0 if self.jobs else 1], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.kfac.dp_group)
        if int(done):
            self._install()

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

    def run_planned(self, bubble: tuple) -> None:
        """The curvature tasks the plan puts in ``bubble`` (:func:`~.memory.plan_fills`: predicted
        durations, the same placement on every run), those pending."""
        kfac = self.kfac
        for which, i, k in self.planned.get(bubble, ()):
            saved = kfac.layers[i].saved_inputs if which == "A" else kfac.layers[i].saved_grads
            if k in saved:
                (kfac.curvature_a if which == "A" else kfac.curvature_b)(i, k)
                self.tasks_run += 1

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

    def __init__(
        self, kfac: KFAC, base: torch.optim.Optimizer, worker: BubbleWorker, names: StateNames
    ) -> None:
        super().__init__(kfac, base)
        self.worker, self.names = worker, names

    # the checkpoint's extra-state hook (pipewright.runtime.checkpointing.checkpoint.ExtraState; see .state)
    def extra_state(self) -> dict[str, torch.Tensor]:
        return save_state(self, self.names)

    def extra_wanted(self, stored: Mapping[str, object]) -> list[str]:
        return wanted_keys(self.names, stored)

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        load_state(self, self.names, state)

    @torch.no_grad()
    def step(self) -> float:
        """Under mixed precision :class:`~pipewright.runtime.parallel.zero.MasterOptimizer` calls this once
        the
        fp32 master gradients are set (unscaled, clipped): preconditioning, KL-clipping and the base
        update act on them. A step the loss scaler skips never gets here (see
        :meth:`BubbleWorker.begin_iteration`)."""
        self.worker.stepped()
        self.worker.step_sync()
        if not self.worker.has_bubbles:  # nowhere else to run them (PipeFisher: after the pipeline)
            self.worker.drain()
        self.worker.install_agreed()
        for i, st in enumerate(self.kfac.layers):
            if st.preconditioned is None or self.worker.dp > 1:
                self.kfac.precondition(i, stepped=True)
        nu = self.kfac.apply(self.base.param_groups[0]["lr"])
        self.base.step()
        self.steps += 1
        return nu


def kfac_handlers(
    worker: BubbleWorker, budgets: dict[tuple, float], *, opportunistic: bool = False
) -> dict[str, Callable]:
    """Executor handlers: F records, KFAC_FILL fills a bubble, KFAC_PRECOND preconditions, and with
    ``opportunistic`` the receives run tasks while they wait."""
    from pipewright.runtime.core.executor import default_handlers

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
        if worker.planned is not None:
            worker.run_planned((a.stage, a.payload))
        elif math.isinf(worker.fill_scale):  # every pending task, whatever the bubble (reproducible)
            worker.drain()
        elif worker.unit_s is not None:
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
            worker.begin_iteration(state.executor.iteration)
            work, _ = comm.pending_receive(a)
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
            if failed:
                comm.take_received(a)
                raise failed[0]
            state.received[a] = comm.take_received(a)

        out[RECV_F] = recv
        out[RECV_B] = recv
    return out


def attach_kfac(
    stages: dict[int, nn.Module], schedule: Schedule, base: torch.optim.Optimizer, **options: Any
) -> tuple[PipelinedKFAC, dict[str, Callable], Schedule]:
    """K-FAC over the covered linears of this rank's ``stages`` (not the output layer): the optimizer,
    the executor handlers and the schedule with bubble and preconditioning actions. ``options``: those
    of :func:`attach_slotted` (``dp_group``, ``dp``, ``config``, ``grad_scale``, ``opportunistic``,
    ``loss_scale``: fp16's loss scale, see :class:`KFAC`; ``names``: the layer and layout names its
    checkpoint state is saved under, default the layers' names on this rank, the schedule, this
    process's rank)."""
    sched, budgets = slot_schedule(schedule)
    opt, handlers = attach_slotted(stages, schedule, budgets, base, **options)
    return opt, handlers, sched


def attach_slotted(
    stages: dict[int, nn.Module],
    schedule: Schedule,
    budgets: dict[tuple, float],
    base: torch.optim.Optimizer,
    *,
    dp_group=None,
    dp: int = 1,
    config: KFACConfig | None = None,
    grad_scale: float = 1.0,
    opportunistic: bool = False,
    loss_scale: Callable[[], float] | None = None,
    names: StateNames | None = None,
) -> tuple[PipelinedKFAC, dict[str, Callable]]:
    """:func:`attach_kfac` for a ``schedule`` (compute-only) whose slotted form the caller already has
    (``budgets`` from :func:`~.fill.slot_schedule`): the optimizer and the executor handlers."""
    layers, stage_of = [], []
    for s, mod in sorted(stages.items()):
        for name, m in covered_layers(mod):
            layers.append((f"{s}.{name}", m))
            stage_of.append(s)
    kfac = KFAC(layers, config, grad_scale=grad_scale, dp_group=dp_group, loss_scale=loss_scale)
    mine = set(stages)
    worker = BubbleWorker(
        kfac,
        stage_of,
        schedule.num_microbatches,
        dp=dp,
        min_interval=kfac.config.inv_interval,
        has_bubbles=any(s in mine for s, _ in budgets),
    )
    handlers = kfac_handlers(worker, budgets, opportunistic=opportunistic)
    if names is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        layout = layout_name(
            schedule.name, schedule.num_stages, schedule.num_microbatches, (schedule.num_ranks, 1, dp), ""
        )
        names = StateNames(layout, f"r{rank}", tuple(n for n, _ in layers))
    return PipelinedKFAC(kfac, base, worker, names), handlers
