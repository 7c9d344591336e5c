"""The trainer's reliability hooks in one object: hang reports, non-finite checks, preemption, fault
injection and checkpoint options. The :class:`~pipewright.runtime.core.trainer.Trainer` calls it from a few
places (see docs/reliability.md): around each training step (:meth:`RunGuard.iteration`), each
evaluation (:meth:`RunGuard.evaluation`) and each checkpoint save (:meth:`RunGuard.saving`), a timeout
becomes one report of what every rank was doing. Each concern lives in its own module:

* :mod:`pipewright.runtime.reliability.hang` — every rank's schedule position, and the report when a receive
or a
  collective times out (:mod:`pipewright.runtime.reliability.timeouts` bounds the collectives);
* :mod:`pipewright.runtime.reliability.nonfinite` — NaN/inf in the loss or gradients, agreed over all ranks
before
  the optimizer step; skip the step or stop;
* :mod:`pipewright.runtime.reliability.elastic` — SIGTERM: finish the step, checkpoint, stop;
* :mod:`pipewright.runtime.reliability.faults` — faults injected from ``PIPEWRIGHT_FAULTS`` (tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from pipewright.runtime.checkpointing.checkpoint import SAVE_STAGES
from pipewright.runtime.core.distributed_errors import CollectiveTimeout, DistributedError, RecvTimeout
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.reliability import nonfinite
from pipewright.runtime.reliability.elastic import Preemption
from pipewright.runtime.reliability.faults import FaultPlan
from pipewright.runtime.reliability.hang import (
    PHASES,
    HangError,
    PositionBoard,
    hang_error,
    mesh_rank_label,
    shared_hang,
)
from pipewright.runtime.reliability.timeouts import abort_device_groups, bound_groups, is_timeout

log = logging.getLogger(__name__)


class RunGuard:
    """One rank's reliability state. Construct on every rank (after the mesh), then :meth:`attach` the
    executor."""

    def __init__(
        self,
        mesh: ParallelMesh,
        stages: Mapping[int, nn.Module],
        *,
        out_dir: Path | None,
        on_nonfinite: str = "stop",
        keep_checkpoints: int = 0,
        check_gradients: bool = True,
        collective_timeout_s: float = 600.0,
        steps: int | None = None,
    ) -> None:
        self.mesh, self.stages, self.out_dir = mesh, stages, out_dir
        self.collective_timeout_s = collective_timeout_s
        bound_groups(collective_timeout_s)  # every gloo group's own collectives give up after it too
        self.policy = nonfinite.check_policy(on_nonfinite)
        self.keep = keep_checkpoints
        self.check_gradients = check_gradients  # False under fp16 loss scaling: its scaler skips overflows
        self.rank = mesh.rank
        self.preemption = Preemption().install()
        self.faults = FaultPlan.from_env(mesh.rank, wake=self.preemption.event)
        self.board = PositionBoard.for_default_group()
        self.step = 0
        self.phase = "schedule"  # what the executor's actions belong to: "schedule" or "evaluate"
        self.stop_requested = False
        self.last_nonfinite: str | None = None  # the message of the last non-finite step
        self.steps = steps  # the steps this run does (None: not known)
        self.skipped_in_a_row = 0
        self._rows: tuple = ()

    # -- executor ----------------------------------------------------------------------------------
    def wrap_handler(self, kind: str, inner):
        """The executor's handler wrapper (:meth:`PipelineExecutor.wrap_handlers`): record this rank's
        position before every action (and the schedule it belongs to: training or evaluation), and
        fire the injected faults due there."""
        board, faults = self.board, self.faults

        def handler(state, action) -> None:
            board.set(self.step, self.phase, state.position, action)
            self._rows = state.comm.schedule.actions
            if faults:
                faults.at_action(self.step, state.position, len(state.actions), kind, self.phase)
            inner(state, action)

        return handler

    def attach(self, executor) -> None:
        """Register :meth:`wrap_handler` on ``executor`` (every kind: compute, point-to-point,
        features'), give it this guard's collective timeout and remember its lowered schedule (the rows
        of the hang report's grid)."""
        executor.wrap_handlers(self.wrap_handler)
        executor.collective_timeout_s = self.collective_timeout_s
        bound_groups(self.collective_timeout_s)  # the groups the executor opened
        self.follow(executor)

    def follow(self, executor) -> None:
        """The hang report's grid shows ``executor``'s lowered schedule: call it before running one of
        several attached executors (the asynchronous trainer's windows of different lengths)."""
        self._rows = executor.schedule.actions

    @contextmanager
    def iteration(self, step: int) -> Iterator[None]:
        """Around one training step: a receive or collective that times out — or a failure because a
        peer gave up on one — becomes a :class:`HangError` with every rank's position."""
        self.step = step
        self.board.set(step, "start")
        with self._watch():
            yield

    @contextmanager
    def evaluation(self, done: int) -> Iterator[None]:
        """Around an evaluation after ``done`` steps: as :meth:`iteration`; the report shows each rank
        "evaluating after step ``done``" at its position in the forward-only schedule."""
        step = self.step
        self.step, self.phase = done, "evaluate"
        self.board.set(done, "evaluate")
        try:
            with self._watch():
                yield
        finally:
            self.step, self.phase = step, "schedule"

    @contextmanager
    def saving(self, done: int) -> Iterator[dict]:
        """Around the checkpoint save of ``done`` steps; yields the keyword arguments for
        :func:`~pipewright.runtime.checkpointing.checkpoint.save_checkpoint`. As :meth:`iteration`: a barrier
        or
        DCP collective that times out becomes a report of every rank's stage of the save."""

        def progress(stage: str) -> None:
            self.board.set(done, "checkpoint", action=SAVE_STAGES[stage])
            if self.faults:
                self.faults.in_save(done, stage)

        with self._watch():
            yield {"keep": self.keep, "progress": progress}

    @contextmanager
    def _watch(self) -> Iterator[None]:
        """Timeouts (and failures because a peer gave up on one) inside become a :class:`HangError`."""
        try:
            yield
        except (HangError, nonfinite.NonFiniteError):
            raise
        except (RecvTimeout, CollectiveTimeout) as exc:
            raise self._hang(self._in_phase(exc)) from None
        except Exception as exc:
            if is_timeout(exc):
                raise self._hang(self._named(exc)) from None
            if isinstance(exc, (DistributedError, RuntimeError)):  # a peer's timeout closed our links?
                reported = self._reported_elsewhere(grace_s=2.0)
                if reported is not None:
                    raise reported from exc
            raise

    def _label(self) -> str:
        return mesh_rank_label(self.mesh.layout, self.rank)

    def _named(self, exc: Exception) -> CollectiveTimeout:
        """A raw c10d/gloo timeout (a barrier, a DCP collective) as a line naming this rank and what
        it was doing."""
        first = (str(exc).splitlines() or [""])[0]
        return CollectiveTimeout(
            f"{self._label()}: {self.board.current.describe()}: a collective did not complete within "
            f"{self.collective_timeout_s:g} s ({type(exc).__name__}: {first})"
        )

    def _in_phase(self, exc: DistributedError) -> DistributedError:
        """``exc`` with the phase outside training it happened in (evaluation), if any."""
        now = self.board.current
        if now.phase not in PHASES:
            return exc
        return type(exc)(f"{exc} ({PHASES[now.phase].format(step=now.step)})")

    def _hang(self, exc: Exception) -> HangError:
        m = self.mesh
        row_of, labels = {}, {}
        for r in range(m.layout.size):  # every process, cp and placement included
            row_of[r] = m.layout.coords(m.layout.rank_on_device(r)).pp
            labels[r] = mesh_rank_label(m.layout, r)
        error = hang_error(exc, self.board, self._rows, row_of, labels, self.out_dir)
        abort_device_groups()  # the report is written: NCCL kernels in flight must not hold teardown
        return error

    def _reported_elsewhere(self, grace_s: float) -> HangError | None:
        """The hang another rank claimed within ``grace_s`` (its line and report), else None."""
        end = time.monotonic() + grace_s
        while not (claimed := self.board.claimed()):
            if claimed is None or time.monotonic() > end:
                return None
            time.sleep(0.05)
        error = shared_hang(self.board, wait_s=10.0)
        if error is not None:
            abort_device_groups()
        return error

    # -- optimizer step ----------------------------------------------------------------------------
    def before_optimizer(self, step: int, loss: float) -> bool:
        """Collective: True when the optimizer may step. Agrees over all ranks on non-finite values
        (skipped step or :class:`~pipewright.runtime.reliability.nonfinite.NonFiniteError`) and on a pending
        SIGTERM (then :attr:`stop_requested` is set: checkpoint after this step and stop)."""
        self.board.set(step, "optimizer")
        if self.faults:
            self.faults.corrupt_gradients(step, {s: list(m.parameters()) for s, m in self.stages.items()})
        local_bad = self.check_gradients and nonfinite.local_flag(self.stages)
        bad, preempt = self._agree(local_bad)
        self.stop_requested = self.stop_requested or preempt
        if not bad and not nonfinite.loss_finding(loss):
            self.skipped_in_a_row = 0
            return True
        mine = nonfinite.local_findings(self.stages, self.rank) if local_bad else []
        findings = nonfinite.gather_findings(mine) if bad else []
        findings = findings or nonfinite.loss_finding(loss)
        message = self.last_nonfinite = nonfinite.report(step, findings, self.policy)
        if self.policy == "stop":
            raise nonfinite.NonFiniteError(message)
        if self.rank == 0:
            log.warning("%s", message)
        self.skipped_in_a_row += 1
        if streak := nonfinite.skip_streak_error(self.skipped_in_a_row, self.steps):
            raise nonfinite.NonFiniteError(streak)  # the same on every rank: the counts are agreed
        for m in self.stages.values():
            m.zero_grad(set_to_none=True)
        return False

    def _agree(self, local_bad: bool) -> list[bool]:
        """Collective: [anyone saw non-finite values, anyone got a SIGTERM] (one all-reduce)."""
        flags = [local_bad, self.preemption.requested]
        try:
            return nonfinite.agree_flags(flags, self.mesh.device, self.collective_timeout_s)
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(f"{self._label()}: {exc}") from None

    def preempted(self, step: int) -> bool:
        """Collective: whether any rank got a SIGTERM, for loops whose ranks meet less often than every
        optimizer step (asynchronous windows); setting :attr:`stop_requested` is the caller's, once
        its state is that of a whole step. Timeouts are reported as in :meth:`iteration`."""
        with self._watch():
            self.board.set(step, "preemption check")
            return self._agree(False)[1]

    def close(self) -> None:
        self.board.close()
        self.preemption.uninstall()
