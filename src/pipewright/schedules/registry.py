"""Name → schedule generator. Each family module exports ``SCHEDULES: tuple[ScheduleInfo, ...]``;
adding a family means adding its module to ``_FAMILIES``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache

from pipewright.errors import ScheduleError
from pipewright.ir import Schedule

_FAMILIES = ("classic", "zero_bubble", "vshape", "asynchronous")


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule generator and the facts its docstring states.

    ``build(p, m, v)`` returns the compute-only schedule. ``chunks`` lists the v values it takes
    (``None``: any v ≥ 1). ``min_microbatches(p, v)`` is the least m it accepts; ``check(p, m, v)`` may
    raise a ScheduleError for further rules (Megatron's m mod N). ``memory(p, m, v)`` gives the peak
    microbatches in flight per rank (activation memory in units of one microbatch of a rank's layers).
    """

    name: str
    build: Callable[[int, int, int], Schedule]
    memory: Callable[[int, int, int], list[Fraction]]
    bubble: str
    memory_formula: str
    source: str
    chunks: tuple[int, ...] | None = (1,)
    default_chunks: int = 1
    min_microbatches: Callable[[int, int], int] = lambda p, v: 1
    check: Callable[[int, int, int], None] | None = None
    synchronous: bool = True
    extra: Mapping[str, object] = field(default_factory=dict)


@cache
def _table() -> dict[str, ScheduleInfo]:
    table: dict[str, ScheduleInfo] = {}
    for family in _FAMILIES:
        module = importlib.import_module(f"pipewright.schedules.{family}")
        for entry in module.SCHEDULES:
            table[entry.name] = entry
    return table


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule name, in family order."""
    return tuple(_table())


def info(name: str) -> ScheduleInfo:
    try:
        return _table()[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(_table())}") from None


def check_args(name: str, p: int, m: int, v: int | None) -> tuple[ScheduleInfo, int]:
    """Resolve the schedule and v, raising a one-line ScheduleError for bad input."""
    entry = info(name)
    v = entry.default_chunks if v is None else v
    if p < 1:
        raise ScheduleError(f"{name}: --stages must be at least 1 (got {p})")
    if entry.chunks is not None and v not in entry.chunks:
        raise ScheduleError(
            f"{name}: --virtual {v} is not supported; use {' or '.join(map(str, entry.chunks))}"
        )
    if v < 1:
        raise ScheduleError(f"{name}: --virtual must be at least 1 (got {v})")
    least = entry.min_microbatches(p, v)
    if m < least:
        raise ScheduleError(
            f"{name} with {p} stages needs at least {least} microbatches (got {m}); "
            f"raise --microbatches to {least} or more"
        )
    if entry.check is not None:
        entry.check(p, m, v)
    return entry, v


def build_schedule(name: str, stages: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """Build the named schedule for p = ``stages`` ranks, m = ``microbatches``, v = ``virtual``."""
    entry, v = check_args(name, stages, microbatches, virtual)
    return entry.build(stages, microbatches, v)
