"""Preemption (SIGTERM) and elastic restart of the worker group.

Preemption: schedulers send SIGTERM before they take a node. :class:`Preemption` turns it into a flag
(the handler only sets it); the ranks agree on it once per step, in the all-reduce that also carries
the non-finite flag (:mod:`pipewright.runtime.reliability.nonfinite`), so every rank finishes the same step,
writes
its checkpoint and stops; ``pipewright train`` then exits with :data:`PREEMPTED_EXIT_CODE` and
``--resume`` continues. Asynchronous schedules agree once per window, after it
(:meth:`~pipewright.runtime.reliability.guard.RunGuard.preempted`), and checkpoint the window's end. The
launching process forwards a SIGTERM it receives to its workers (:func:`pipewright.runtime.setup.launch.spawn`
with ``forward_sigterm``).

Elastic restart: :func:`run_with_restarts` reruns the worker group after a worker died or failed, up
to ``max_restarts`` times, resuming from the newest complete checkpoint (at most ``checkpoint_every``
steps are lost). Under torchrun (``--max-restarts``), torchrun's elastic agent restarts the group and
:func:`auto_resume` makes a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) resume from the
checkpoint of ``--out``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipewright.runtime.checkpointing.checkpoint import resumable_checkpoint
from pipewright.runtime.core.distributed_errors import WorkerError
from pipewright.runtime.reliability.faults import RESTART_ENV
from pipewright.runtime.reliability.interrupts import INTERRUPTED
from pipewright.runtime.setup.config import TrainConfig

log = logging.getLogger(__name__)

#: exit status of ``pipewright train`` after a preemption (EX_TEMPFAIL: "try again later")
PREEMPTED_EXIT_CODE = 75


class Preemption:
    """Set by SIGTERM (the handler does nothing else; a second SIGTERM terminates the process);
    :meth:`install` in each worker."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: Any = None

    def install(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if not self.event.is_set():
            self.event.set()
            return
        # a second SIGTERM (the process may be stuck, e.g. in a receive): die as SIGTERM would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def auto_resume(config: TrainConfig) -> TrainConfig:
    """Under torchrun after an elastic restart: resume from ``--out``'s newest complete checkpoint.

    Collective (call after the process group is up): torchrun counts a restart only on the machine
    whose worker failed — the other machines' agents restart theirs as a membership change, with
    ``TORCHELASTIC_RESTART_COUNT`` unchanged — so the ranks take the largest count among them."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if dist.is_initialized():
        counts: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, restarts)
        restarts = max(c or 0 for c in counts)
    if restarts == 0 or config.resume:
        return config
    if config.out is None:
        log.warning("restart %d: no --out, so no checkpoint to resume from; starting over", restarts)
        return config
    found, _ = resumable_checkpoint(Path(config.out) / "checkpoints")
    if found is None:
        return config
    log.warning("restart %d: resuming from %s", restarts, found)
    return replace(config, resume=True)


def steps_done(out_dir: Path) -> int:
    """Steps recorded in ``out_dir/metrics.jsonl`` (one line per finished step), 0 when none."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip()]
    return max(steps) + 1 if steps else 0


def run_with_restarts(
    config: TrainConfig,
    out_dir: Path,
    attempt: Callable[[TrainConfig], Any],
    max_restarts: int,
) -> Any:
    """Call ``attempt(config)``; when a worker fails (:class:`WorkerError`) and restarts are left, call
    it again with ``resume`` set if ``out_dir`` holds a complete checkpoint (from scratch otherwise).
    The restart count is exported as ``PIPEWRIGHT_RESTART_COUNT`` for the new workers."""
    config = replace(config, out=str(out_dir))
    for restart in range(max_restarts + 1):
        os.environ[RESTART_ENV] = str(restart)
        try:
            return attempt(config)
        except WorkerError as exc:
            if restart == max_restarts or "NonFiniteError" in str(exc) or INTERRUPTED.is_set():
                raise  # a NaN would come back; Ctrl-C asked to stop
                raise
            found, warnings = resumable_checkpoint(out_dir / "checkpoints")
            for w in warnings:
                log.warning("%s", w)
            done = steps_done(out_dir)
            if found is None:
                log.warning(
                    "%s; restart %d of %d from step 0 (no checkpoint yet)", exc, restart + 1, max_restarts
                )
                config = replace(config, resume=False)
                continue
            step = int(found.name.split("_")[1])
            log.warning(
                "%s; restart %d of %d from %s (%d finished step(s) to redo)",
                exc,
                restart + 1,
                max_restarts,
                found,
                max(0, done - step),
            )
            config = replace(config, resume=True)
        finally:
            os.environ.pop(RESTART_ENV, None)
    raise AssertionError("unreachable")
