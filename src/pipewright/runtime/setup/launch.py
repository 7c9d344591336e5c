"""Starting the worker processes: local spawning for tests and single-node runs, or torchrun's.

:func:`spawn` starts ``nprocs`` processes (spawn start method), each with one CPU thread and an
initialised default process group (gloo, or NCCL with ``cuda:rank``), runs ``fn(rank, *args)`` in
each and returns the values they return, ordered by rank. A worker that raises or dies makes the
others terminate (torch's ProcessContext) and :class:`WorkerError` names its rank; a run longer than
``timeout_s`` is terminated too. Under torchrun, :func:`init_from_env` joins torchrun's group instead.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from pipewright.runtime.core.distributed_errors import DistributedError, WorkerError
from pipewright.runtime.reliability.interrupts import forwarding_signals, workers_ignore_sigint
from pipewright.runtime.reliability.timeouts import use_nccl_group_timeout, watchdog_timeout
from pipewright.runtime.setup import nccl_rules
from pipewright.runtime.setup.host_memory import use_cpu_allocator
from pipewright.runtime.setup.startup import stage

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def running_under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) set RANK, WORLD_SIZE and LOCAL_RANK."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(
    backend: str | None = None,
    timeout_s: float = 600.0,
    threads: int | None = 1,
    cpu_allocator: str = "retain",
    collective_timeout_s: float = 600.0,
) -> None:
    """Initialise the default process group from env:// variables (torchrun, or :func:`spawn`).

    Under torchrun's elastic agent with its shared store (``TORCHELASTIC_USE_AGENT_STORE=True``) the
    group lives in a namespace of that store fresh for this attempt (:func:`attempt_store`). With NCCL
    the current CUDA device becomes ``LOCAL_RANK`` and the group is bound to it (``device_id``: eager
    communicator creation; every ``new_group`` inherits the device); its timeout — NCCL's watchdog —
    is ``collective_timeout_s`` plus the hang report's margin
    (:func:`~pipewright.runtime.reliability.timeouts.watchdog_timeout`; the run guard sets it again from the
    run's ``--collective-timeout``), gloo's is ``timeout_s``. ``threads`` sets torch's CPU threads.
    With gloo (tensors on the CPU) ``cpu_allocator`` sets how freed tensor memory is kept
    (:mod:`.host_memory`).
    """
    backend = backend or default_backend()
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "gloo":
        use_cpu_allocator(cpu_allocator)
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        options = {"timeout": watchdog_timeout(collective_timeout_s), "device_id": device}
        use_nccl_group_timeout(collective_timeout_s)
    if dist.is_initialized():
        return
    with stage("joining the process group", enabled=os.environ.get("RANK", "0") == "0"):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = attempt_store(rank, world, datetime.timedelta(seconds=timeout_s))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)
        else:
            dist.init_process_group(backend, **options)
    nccl_rules.install_from_env()  # PIPEWRIGHT_PG_RULES=nccl: NCCL's rules over gloo


def attempt_store(
    rank: int, world_size: int, timeout: datetime.timedelta, window_s: float = 0.5
) -> dist.Store:
    """The agent's store (``MASTER_ADDR:MASTER_PORT``) under a prefix that only this attempt's workers use.

    Why: torch 2.13's c10d rendezvous keeps one TCPStore server for the whole job and its env://
    handler adds no per-attempt prefix, so after an elastic restart ``init_process_group`` finds the
    previous attempt's keys (gloo: the dead peers' addresses, "Connection refused" on an old port; the
    store barrier's counters) — pytorch/pytorch#135712. ``TORCHELASTIC_RESTART_COUNT`` cannot name the
    attempt: torchrun counts a restart only on the machine whose worker failed.

    The handshake: rank 0 draws a random attempt id ``u`` and sets ``current = u``; every other rank
    reads ``current``, writes a nonce of its own under ``u/hello/<rank>`` and waits ``window_s`` for
    rank 0 to echo it under ``u/ack/<rank>``. Rank 0 only answers in its own (fresh) namespace, so a rank
    that read the previous attempt's ``current`` hears no echo of its nonce and reads again. All old
    workers are dead before a new attempt starts (the agents stop them before the rendezvous round
    completes), so nothing rewrites ``current`` behind rank 0.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timeout=timeout
    )
    base = f"pipewright/{run_id}/"
    if rank == 0:
        attempt = uuid.uuid4().hex
        client.set(base + "current", attempt)
        hellos = [f"{base}{attempt}/hello/{r}" for r in range(1, world_size)]
        if hellos:
            client.wait(hellos)
            client.multi_set([k.replace("/hello/", "/ack/") for k in hellos], client.multi_get(hellos))
    else:
        nonce = uuid.uuid4().hex.encode()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            attempt = client.get(base + "current").decode()
            client.set(f"{base}{attempt}/hello/{rank}", nonce)
            if _echoed(client, f"{base}{attempt}/ack/{rank}", nonce, window_s):
                break
            # no echo: rank 0 is slow, or ``current`` was the previous attempt's: read it again
            if time.monotonic() > deadline:
                raise DistributedError(f"rank {rank}: no answer from rank 0 in torchrun's store in {timeout}")
    log.debug("rank %d: process group of attempt %s (run %s)", rank, attempt, run_id)
    return dist.PrefixStore(f"{base}{attempt}/", client)


def _echoed(store: dist.Store, key: str, value: bytes, window_s: float) -> bool:
    """Whether ``key`` holds ``value`` within ``window_s`` (polled: a timed-out ``wait`` logs warnings)."""
    end = time.monotonic() + window_s
    while True:
        if store.check([key]) and store.get(key) == value:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def _worker(
    rank: int,
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any],
    backend: str,
    port: int,
    result_dir: str,
    timeout_s: float,
    cpu_allocator: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    init_from_env(backend, timeout_s, cpu_allocator=cpu_allocator)
    try:
        result = fn(rank, *args)
        with open(Path(result_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        # Nobody tears down the group (rank 0 hosts the store) while a peer may still be talking to it.
        dist.barrier()
        (Path(result_dir) / f"done-{rank}").touch()  # every rank's result is written: only teardown is left
    except BaseException as e:
        # Stamp the failure so the parent can report the first one, not its peers' "connection reset".
        last = (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
        (Path(result_dir) / f"error-{rank}.txt").write_text(f"{time.time()}\n{last}")
        raise
    finally:
        if dist.is_initialized():  # not after a hang report on NCCL: its groups were aborted
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    forward_sigterm: bool = False,
    cpu_allocator: str = "retain",
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes; return their results by rank.

    ``fn`` must be importable (a module-level function) and its result picklable. Raises
    :class:`WorkerError` naming the first worker that raised or died, or that the run passed
    ``timeout_s``; the other workers are terminated, so the caller never hangs. ``forward_sigterm``:
    a SIGTERM or SIGINT to this process is passed on to the workers as SIGTERM (which may checkpoint
    and return) instead of killing this process and orphaning them
    (:mod:`pipewright.runtime.reliability.interrupts`). ``cpu_allocator``: see :func:`init_from_env`.
    """
    backend = backend or default_backend()
    with tempfile.TemporaryDirectory(prefix="pipewright-spawn-") as result_dir:
        with workers_ignore_sigint() if forward_sigterm else nullcontext():  # reliability/interrupts.py
            context = mp.start_processes(
                _worker,
                args=(fn, nprocs, tuple(args), backend, free_port(), result_dir, timeout_s, cpu_allocator),
                nprocs=nprocs,
                join=False,
                start_method="spawn",
            )
        deadline = time.monotonic() + timeout_s
        forwarding = forwarding_signals(context.processes) if forward_sigterm else nullcontext()
        with forwarding:
            try:
                while not context.join(
                    timeout=min(1.0, max(0.0, deadline - time.monotonic())), grace_period=2
                ):
                    if time.monotonic() > deadline:
                        _terminate(context.processes)
                        raise WorkerError(
                            -1, f"workers did not finish within {timeout_s:g} s; terminated them"
                        )
            except ProcessException as e:
                if not _all_done(result_dir, nprocs):
                    raise _first_failure(e, result_dir) from None
                # every rank wrote its result and passed the final barrier: the failure is in teardown
                # (e.g. a C++ abort while destroying the process group), not in the work
                log.warning(
                    "a worker failed after all results were written (%s); using the results", e.msg.strip()
                )
                _terminate(context.processes)
        results = []
        for rank in range(nprocs):
            with open(Path(result_dir) / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _all_done(result_dir: str, nprocs: int) -> bool:
    return all((Path(result_dir) / f"done-{rank}").exists() for rank in range(nprocs))


def _first_failure(e: ProcessException, result_dir: str) -> WorkerError:
    """A worker killed by a signal (it leaves no stamp; its peers then fail on a closed connection),
    else the worker that failed first (by the time stamps workers leave), else the one torch reports."""
    rank = e.error_index
    if (
        isinstance(e, mp.ProcessExitedException)
        and e.signal_name
        and not (Path(result_dir) / f"error-{rank}.txt").exists()
    ):
        return WorkerError(rank, f"worker rank {rank} was killed by {e.signal_name}", e.msg)
    stamps = []
    for path in Path(result_dir).glob("error-*.txt"):
        when, _, message = path.read_text().partition("\n")
        stamps.append((float(when), int(path.stem.split("-")[1]), message))
    if stamps:
        _, rank, message = min(stamps)
        details = e.msg if isinstance(e, mp.ProcessRaisedException) and e.error_index == rank else ""
        return WorkerError(rank, f"worker rank {rank} failed: {message}", details)
    return WorkerError(e.error_index, f"worker rank {e.error_index} died: {e.msg.strip()}", e.msg)


def _terminate(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
