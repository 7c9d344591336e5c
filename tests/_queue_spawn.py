"""Launching a test's workers: :func:`spawn_cases` runs a test's cases in fresh gloo processes that report
through a queue; :func:`fork_launch` runs ``fn(rank, *args)`` like
:func:`pipewright.runtime.setup.launch.spawn` in processes forked from the test process, so that torch and the
test's modules, already imported here, are not imported again in every worker (seconds of CPU each);
:func:`forked_cli_launches` makes the library's own launches (``pipewright train``, ``pipewright check``
called in-process through ``pipewright.cli.main``) fork the same way, through their ``spawn`` hook
(:func:`pipewright.training.workers.launching_with`)."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipewright.runtime.core.distributed_errors import WorkerError
from pipewright.runtime.setup import nccl_rules
from pipewright.runtime.setup.launch import default_backend, free_port, init_from_env
from pipewright.runtime.setup.launch import spawn as _spawn

# Multi-process tests run under NCCL's rules over gloo (PIPEWRIGHT_PG_RULES=off to run plain gloo).
os.environ.setdefault(nccl_rules.ENV, "nccl")
# ... with NCCL's lazy point-to-point connection: a pair's first send/receive blocks until the peer's
# (PIPEWRIGHT_PG_LAZY_CONNECT= empty to turn it off); 30 s, under the workers' 60 s group timeout.
os.environ.setdefault(nccl_rules.LAZY_ENV, "30")

#: ``cases(rank, world) -> {case: error or ""}``, run inside an initialised gloo process group
Cases = Callable[[int, int], dict[str, str]]


def _worker(cases: Cases, rank: int, world: int, init_file: str, queue) -> None:
    """One spawned rank: single-threaded torch, a gloo group over ``init_file``, ``cases`` reported."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    nccl_rules.install_from_env()
    try:
        queue.put((rank, cases(rank, world)))
    finally:
        dist.destroy_process_group()


def spawn_cases(cases: Cases, world: int) -> dict[str, list[str]]:
    """Run ``cases(rank, world)`` on ``world`` gloo processes (a module-level function, so it pickles;
    forked where :func:`can_fork`). Returns case → one entry per reporting rank ("rank r: error" or "")."""
    ctx = mp.get_context("fork" if can_fork() else "spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(cases, r, world, init_file, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        got = [queue.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
    merged: dict[str, list[str]] = {}
    for rank, results in sorted(got):
        for name, err in results.items():
            merged.setdefault(name, []).append(f"rank {rank}: {err}" if err else "")
    return merged


def can_fork() -> bool:
    """Whether workers may be forked from this process: no process group of its own (a child would
    inherit it) and no CUDA context (which does not survive a fork)."""
    return (
        not dist.is_initialized() and not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods()
    )


def _forked(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    args: Sequence[Any],
    port: int,
    timeout_s: float,
    queue,
    cpu_allocator: str = "retain",
) -> None:
    """One forked rank: the environment and gloo group ``pipewright.runtime.setup.launch`` gives a worker
    (one CPU thread), ``fn(rank, *args)``, then (rank, "ok", result) or (rank, "error", traceback)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
    )  # fmt: skip
    try:
        init_from_env("gloo", timeout_s, cpu_allocator=cpu_allocator)
        result = fn(rank, *args)
        queue.put((rank, "ok", pickle.dumps(result)))  # by value: no shared memory outliving this process
        dist.barrier()  # nobody tears the group down while a peer may still be talking to it
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        queue.close()
        queue.join_thread()
        os._exit(0)  # no atexit handlers or finalizers inherited from the test process


def fork_launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    timeout_s: float = 600.0,
    cpu_allocator: str = "retain",
) -> list:
    """``fn(rank, *args)`` on ``nprocs`` gloo ranks; their results by rank (as
    :func:`pipewright.runtime.setup.launch.spawn`, which it falls back to where :func:`can_fork` is false).
    A rank that raises fails the call with its traceback; so does passing ``timeout_s``. A forked
    worker starts from this process's heap and allocator settings: ``cpu_allocator="system"`` leaves
    them as they are rather than resetting glibc's defaults."""
    if not can_fork():
        return _spawn(fn, nprocs, args, backend="gloo", timeout_s=timeout_s, cpu_allocator=cpu_allocator)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_forked, args=(fn, r, nprocs, tuple(args), port, timeout_s, queue, cpu_allocator))
        for r in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < nprocs:
            try:
                rank, status, value = queue.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"a worker died ({dead[0].exitcode})" if dead else f"past {timeout_s:g} s"
                    raise RuntimeError(f"forked workers: {why}") from None
                continue
            if status == "error":
                raise RuntimeError(f"forked worker rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    return [results[r] for r in range(nprocs)]


def forked_spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    forward_sigterm: bool = False,
    cpu_allocator: str = "retain",
) -> list:
    """:func:`pipewright.runtime.setup.launch.spawn`'s signature over :func:`fork_launch` (gloo only; no
    SIGTERM forwarding, so not for tests that signal the launcher). A failed launch raises
    :class:`~pipewright.runtime.core.distributed_errors.WorkerError`, as ``spawn`` does, so the CLI reports it
    the same."""
    if (backend or default_backend()) != "gloo":
        return _spawn(
            fn, nprocs, args, backend=backend, timeout_s=timeout_s, forward_sigterm=forward_sigterm,
            cpu_allocator=cpu_allocator,
        )  # fmt: skip
    try:
        return fork_launch(fn, nprocs, args, timeout_s=timeout_s, cpu_allocator=cpu_allocator)
    except RuntimeError as e:
        raise WorkerError(-1, str(e).splitlines()[0], str(e)) from None


@contextmanager
def forked_cli_launches() -> Iterator[None]:
    """Within the block, the library's local launches fork their workers from this process
    (:func:`forked_spawn`) instead of spawning fresh interpreters: for tests of what the CLI computes,
    not of how it starts processes."""
    from pipewright.training.workers import launching_with

    with launching_with(forked_spawn):
        yield
