"""A schedule as PyTorch's schedule CSV (``torch.distributed.pipelining``'s format), compute-only or
lowered with its send/receive actions; the reading side is :mod:`pipewright.codec`."""

from __future__ import annotations

from pipewright.codec import rows_to_csv
from pipewright.ir import Schedule
from pipewright.passes.lower import lower, strip_comms


def to_csv(schedule: Schedule, with_comms: bool = False) -> str:
    """PyTorch's CSV: compute-only (``with_comms=False``) or lowered with send/receive actions."""
    sched = lower(schedule) if with_comms else strip_comms(schedule)
    return rows_to_csv(sched.actions)
