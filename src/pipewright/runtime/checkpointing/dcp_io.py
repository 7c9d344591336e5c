"""``torch.distributed.checkpoint`` (DCP) for :mod:`pipewright.runtime.checkpointing.checkpoint`, imported on
the first
save or load: DCP pulls in DTensor and sympy, ≈ 40 % of a training process's import time, which a run
that never checkpoints need not pay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def dcp_module() -> tuple[ModuleType, type[Exception]]:
    """(``torch.distributed.checkpoint``, its ``CheckpointException``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    return dcp, CheckpointException


def reporting_writer(path: Path, progress: Callable[[str], None]):
    """DCP's file writer for ``path`` that tells ``progress`` when this rank starts writing its shards
    ("write") and when it is done ("wait": it then waits in DCP's collective for the other ranks)."""
    dcp, _ = dcp_module()

    class ReportingWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            progress("write")
            written = super().write_data(plan, planner)
            written.wait()
            progress("wait")
            return written

    return ReportingWriter(str(path))
