"""Run a test's cases in fresh gloo processes that report through a queue (shared by the multi-process
test files whose cases collect per-case error strings)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: ``cases(rank, world) -> {case: error or ""}``, run inside an initialised gloo process group
Cases = Callable[[int, int], dict[str, str]]


def _worker(cases: Cases, rank: int, world: int, init_file: str, queue) -> None:
    """One spawned rank: single-threaded torch, a gloo group over ``init_file``, ``cases`` reported."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        queue.put((rank, cases(rank, world)))
    finally:
        dist.destroy_process_group()


def spawn_cases(cases: Cases, world: int) -> dict[str, list[str]]:
    """Run ``cases(rank, world)`` on ``world`` spawned gloo processes (a module-level function, so it
    pickles). Returns case → one entry per reporting rank ("rank r: error" or "")."""
    ctx = mp.get_context("spawn")
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
