"""Run a test's worker in fresh processes that report through a queue (shared by the multi-process
test files whose workers collect per-case error strings)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch.multiprocessing as mp


def spawn_cases(worker: Callable, world: int) -> dict[str, list[str]]:
    """Start ``worker(rank, world, init_file, queue)`` on ``world`` processes; each puts
    ``(rank, {case: error or ""})``. Returns case → one entry per rank ("rank r: error" or "")."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, world, init_file, queue)) for r in range(world)]
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
