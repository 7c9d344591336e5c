"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""

from __future__ import annotations


class PipewrightError(Exception):
    """Base class: the message says what to change."""


class ScheduleError(PipewrightError):
    """A schedule cannot be built with the given parameters (p, m, v, name)."""


class ValidationError(PipewrightError):
    """A schedule breaks a dependency, misses or duplicates an action, or deadlocks.

    The first line of the message names rank, position and action; the text grid follows.
    """

    def __init__(self, message: str, grid: str = "") -> None:
        super().__init__(message)
        self.grid = grid

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n{self.grid}" if self.grid else base


class ConfigError(PipewrightError):
    """Bad command-line or config-file input."""
