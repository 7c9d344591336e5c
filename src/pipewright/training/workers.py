"""Running a prepared training run: the local worker processes (or torchrun's), each running
:func:`train_worker`, the step loop around :class:`~pipewright.runtime.core.trainer.Trainer` with evaluation,
checkpoints and preemption; rank 0 writes the run's files (:mod:`pipewright.runtime.profiling.artifacts`).

Local runs start their processes with :func:`pipewright.runtime.setup.launch.spawn`, or with the ``spawn``
given to :func:`train`, or, within :func:`launching_with`, with that block's (:func:`launcher`): the
hook through which the CLI's runs (``pipewright train``, ``pipewright check``, called in-process) can
start their workers another way, e.g. forked from the caller in tests."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipewright.runtime.checkpointing.run_folder import RunLock, claim
from pipewright.runtime.core.trainer import PreparedRun, Trainer, TrainResult
from pipewright.runtime.profiling.artifacts import MetricsWriter, write_artifacts
from pipewright.runtime.reliability import elastic
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import init_from_env, running_under_torchrun
from pipewright.runtime.setup.launch import spawn as spawn_processes
from pipewright.runtime.setup.startup import stage
from pipewright.training.prepare_run import prepare

log = logging.getLogger(__name__)

#: :func:`pipewright.runtime.setup.launch.spawn`'s signature: ``spawn(fn, nprocs, args, *, backend=None,
#: timeout_s=600.0, forward_sigterm=False, cpu_allocator="retain")`` → the workers' results by rank
Spawn = Callable[..., list[Any]]

_LAUNCHER: ContextVar[Spawn | None] = ContextVar("pipewright_launcher", default=None)


@contextmanager
def launching_with(spawn: Spawn) -> Iterator[None]:
    """Within the block, local runs that are given no ``spawn`` start their workers with ``spawn``."""
    token = _LAUNCHER.set(spawn)
    try:
        yield
    finally:
        _LAUNCHER.reset(token)


def launcher(spawn: Spawn | None = None) -> Spawn:
    """The function that starts a local run's workers: ``spawn`` if given, else the innermost
    :func:`launching_with` block's, else :func:`pipewright.runtime.setup.launch.spawn` (fresh processes)."""
    return spawn or _LAUNCHER.get() or spawn_processes


def train(
    config: TrainConfig, prepared: PreparedRun | None = None, *, spawn: Spawn | None = None
) -> TrainResult:
    """Prepare, then run the workers: torchrun's processes when launched by torchrun, else
    tp × cp × pp × dp local processes (one CPU thread each), started by :func:`launcher` (``spawn``).
    Returns rank 0's result (others: None under torchrun). ``prepared``: ``prepare(config)`` already
    made by the caller (local runs; its checks are not repeated)."""
    if running_under_torchrun():
        init_from_env(cpu_allocator=config.cpu_allocator, collective_timeout_s=config.collective_timeout_s)
        with stage("checking the layout and the data", enabled=dist.get_rank() == 0):
            run = prepare(elastic.auto_resume(config), world_size=int(os.environ["WORLD_SIZE"]))
        lock = _claim(run) if dist.get_rank() == 0 else None
        chosen = [str(run.out_dir) if lock is None else str(lock.folder)]  # rank 0's folder
        dist.broadcast_object_list(chosen, src=0)
        run = replace(run, out_dir=Path(chosen[0]))
        with lock or nullcontext():
            return train_worker(dist.get_rank(), run)
    if prepared is None:
        with stage("checking the layout and the data"):
            prepared = prepare(config)
    run = prepared
    lock = _claim(run)
    run = replace(run, out_dir=lock.folder)
    if config.out is None:
        _point_latest(run.out_dir)
    with lock:
        return _train_local(config, run, launcher(spawn))


def _claim(run: PreparedRun) -> RunLock:
    """The run folder, locked for the run's life (a new default folder; an old run moved aside)."""
    c = run.config
    given = Path(c.out) if c.out else None
    return claim(given, run.out_dir.parent, resume=c.resume, overwrite=c.overwrite)[1]


def _train_local(config: TrainConfig, run: PreparedRun, spawn: Spawn) -> TrainResult:
    prepared = [run]

    def attempt(c: TrainConfig) -> TrainResult:
        again = prepared.pop() if prepared else prepare(c)  # a restart resumes from the newest checkpoint
        return spawn(
            train_worker,
            c.world_size,
            (again,),
            timeout_s=7 * 24 * 3600,
            forward_sigterm=True,
            cpu_allocator=c.cpu_allocator,
        )[0]

    if not config.max_restarts:
        return attempt(config)
    return elastic.run_with_restarts(config, run.out_dir, attempt, config.max_restarts)


def _point_latest(out_dir: Path) -> None:
    """Make ``runs/latest`` a symbolic link to the new default output folder (replaced atomically)."""
    link, tmp = out_dir.parent / "latest", out_dir.parent / ".latest.tmp"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out_dir.name)
        os.replace(tmp, link)
    except OSError as exc:  # e.g. no symbolic links on this filesystem: not worth failing the run
        log.warning("could not point %s at %s: %s", link, out_dir, exc)


def train_worker(rank: int, run: PreparedRun) -> TrainResult | None:
    """One process's training loop (see the module docstring). Collective: every rank runs it."""
    c = run.config
    torch.manual_seed(c.seed + rank)
    with stage("building the model", enabled=rank == 0):
        trainer = Trainer(run)  # with the run's training plugins (asynchronous weights, K-FAC, …)
    start = 0
    if run.resume_from is not None:
        with stage("loading the checkpoint", enabled=rank == 0):
            start = trainer.load(run.resume_from)
    if start:
        log.info("rank %d resumed from %s at step %d", rank, run.resume_from, start)
    writer = MetricsWriter(run, start, trainer.tokens_per_step) if rank == 0 else None
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    t_run = time.perf_counter()
    end = min(c.steps, c.stop_after) if c.stop_after else c.steps
    done = start
    for step in range(start, end):
        with stage(f"step {step + 1} of {c.steps}", enabled=rank == 0 and step == start):
            record = trainer.train_step(step)
        done = step + 1
        if c.eval_every and (done % c.eval_every == 0 or done == c.steps):
            record["val_loss"] = val_losses[step] = trainer.evaluate(done)
        losses.append(record["loss"])
        if writer is not None:
            writer.write(record)
        preempted = trainer.guard.stop_requested
        if (c.checkpoint_every and done % c.checkpoint_every == 0) or done == end or preempted:
            trainer.save(done)
        if preempted:  # SIGTERM: every rank finished this step and saved it (elastic.Preemption)
            log.warning("rank %d: preempted, stopping after step %d (checkpoint written)", rank, done)
            break
    trainer.guard.close()
    wall = time.perf_counter() - t_run
    if writer is None:
        return None
    writer.close()
    files = write_artifacts(run, trainer.timeline) if c.artifacts else {}
    files["metrics"] = writer.path
    rate = len(losses) * trainer.tokens_per_step / wall if wall > 0 else 0.0
    stopped = done if trainer.guard.stop_requested and done < end else None
    return TrainResult(losses, val_losses, run.out_dir, files, wall, rate, preempted_at=stopped)
