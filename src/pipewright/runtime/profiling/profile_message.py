"""The profile's MESSAGE row: the one-way time of the stage-boundary tensor between two pipeline ranks
(:mod:`pipewright.runtime.profiling.profiler`), or, on a single GPU, of a device-to-device copy of it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def message_time(
    peer: int,
    elems: int,
    repeats: int,
    warmup: int,
    first: bool,
    between: Callable[[], None],
    buf: torch.Tensor | None = None,
    sync: Callable[[], None] = lambda: None,
) -> float:
    """One-way time of ``buf`` (default: a CPU float32 tensor of ``elems`` elements; on CUDA the
    boundary tensor on the GPU in the run's dtype), as a pipeline sees it: rank 0 computes
    (``between``, a layer's forward) while rank 1 waits blocked in its receive, then rank 0 sends and
    rank 1 echoes at once; half the round trip (timed from the send, to the echo's arrival: ``sync``
    waits for the device) includes waking the blocked receiver, not only a hot socket. The mean of the
    fastest 95 % (a pipeline's critical path adds up means; the cut drops rare hiccups)."""
    buf = torch.zeros(elems) if buf is None else buf
    samples = []
    for i in range(warmup + repeats):
        if first:
            between()
            sync()
            t0 = time.perf_counter()
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
            sync()
            if i >= warmup:
                samples.append((time.perf_counter() - t0) / 2)
        else:
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)
            sync()
    if not first:
        return 0.0
    samples.sort()
    return statistics.fmean(samples[: max(1, int(len(samples) * 0.95))])


def copy_time(buf: torch.Tensor, repeats: int, warmup: int, sync: Callable[[], None]) -> float:
    """Seconds of a device-to-device copy of ``buf`` (the mean of the fastest 95 %)."""
    out = torch.empty_like(buf)
    samples = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        out.copy_(buf)
        sync()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return statistics.fmean(samples[: max(1, int(len(samples) * 0.95))])
