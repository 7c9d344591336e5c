"""Measured timelines: per-action times of one step (:class:`ActionClock`) and the executor's spans of
one pipeline replica gathered to global rank 0."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.timeline import Span, Timeline


class ActionClock:
    """Start and end times of a step's actions without synchronising inside the step: wall clock on the
    CPU; on CUDA an event recorded on the current stream at every mark, read (:meth:`intervals`) after
    the step's one synchronize, so the host keeps launching ahead of the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.origin = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Mark the step's start (times are seconds since it)."""
        self.origin = self._now()

    def mark(self) -> None:
        """Mark an action's start or end (called twice per action)."""
        self.marks.append(self._now())

    def intervals(self) -> list[tuple[float, float]]:
        """(start, end) per action in seconds since :meth:`start`; on CUDA only after a synchronize."""
        if self.cuda:
            times = [self.origin.elapsed_time(e) / 1e3 for e in self.marks]
        else:
            times = [t - self.origin for t in self.marks]
        return list(zip(times[0::2], times[1::2], strict=True))


def gather_timeline(spans: list[Span], mesh: ParallelMesh) -> Timeline | None:
    """Collective over the pp group: the spans of every pp rank of global rank 0's replica (dp 0, tp 0,
    cp 0 unless a placement moves it), as a measured :class:`Timeline` on global rank 0 (None elsewhere).

    Span times are seconds since the iteration start, which each rank takes right after a barrier of
    its pp group (``PipelineExecutor(record=True)``), so clocks agree up to the barrier's exit skew (on
    CUDA: the start event is recorded after the barrier, so up to the devices' queue depths as well).
    """
    layout = mesh.layout
    home = layout.coords(layout.rank_on_device(0)) if layout is not None else None  # global rank 0's
    mine = (mesh.dp_rank, mesh.tp_rank, getattr(mesh, "cp_rank", 0))
    if mine != ((home.dp, home.tp, home.cp) if home is not None else (0, 0, 0)):
        return None  # (with a plan's placement, global rank 0 need not hold dp 0, tp 0)
    gathered: list[list[Span]] | None = [None] * mesh.pp if mesh.rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(spans, gathered, dst=0, group=mesh.pp_group)
    if gathered is None:
        return None
    spans_all = [s for part in gathered for s in part]
    return Timeline.of(mesh.pp, spans_all, source="measured", meta={"dp": mesh.dp})  # replica dp 0 drawn
