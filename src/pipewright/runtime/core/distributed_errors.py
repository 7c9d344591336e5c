"""Errors raised while running a pipeline on torch.distributed (all PipewrightErrors: one line)."""

from __future__ import annotations

from pipewright.errors import PipewrightError


class DistributedError(PipewrightError):
    """A distributed run failed; the message names the rank and what it was doing."""


class LayoutError(DistributedError):
    """dp × pp × tp does not match the number of processes."""


class RecvTimeout(DistributedError):
    """A receive did not complete within the configured timeout."""


class ActionError(DistributedError):
    """An action's handler raised; the message names rank, position and action."""


class WorkerError(DistributedError):
    """A spawned worker raised or died; ``rank`` is its rank, ``details`` its traceback text."""

    def __init__(self, rank: int, message: str, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details


class CollectiveTimeout(DistributedError):
    """A collective (all-reduce, barrier, a feature's group collective) did not complete in time."""
