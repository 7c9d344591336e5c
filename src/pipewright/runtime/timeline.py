"""Measured timelines: gather the executor's spans of one pipeline replica to global rank 0."""

from __future__ import annotations

import torch.distributed as dist

from pipewright.runtime.mesh import ParallelMesh
from pipewright.timeline import Span, Timeline


def gather_timeline(spans: list[Span], mesh: ParallelMesh) -> Timeline | None:
    """Collective over the pp group: the spans of every pp rank of global rank 0's replica (dp 0, tp 0,
    cp 0 unless a placement moves it), as a measured :class:`Timeline` on global rank 0 (None elsewhere).

    Span times are seconds since the iteration start, which each rank takes right after a barrier of
    its pp group (``PipelineExecutor(record=True)``), so clocks agree up to the barrier's exit skew.
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
