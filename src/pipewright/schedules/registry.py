"""Name → schedule generator, as an open registry.

Each family module exports ``SCHEDULES: tuple[ScheduleInfo, ...]``; :func:`default_registry` collects the
library's families. A :class:`ScheduleRegistry` is immutable: features add their schedules with
``registry.with_schedules(...)`` (``Features.schedules``) and pass the result to :func:`build_schedule`,
:func:`check_args`, :func:`info` and :func:`schedule_names` through ``registry=``.

Generators may take costs: an entry with ``build_costed`` is built from :class:`ScheduleCosts` (per-stage
F, I, W times, the point-to-point time and a memory limit in microbatches) when the caller has them — from
the cost model or a profile (:func:`pipewright.schedules.schedule_costs.schedule_costs`) — and falls back to
``build`` (unit costs) otherwise; ``zb-auto`` is such an entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from functools import cache

from pipewright.errors import ScheduleError
from pipewright.ir import Schedule
from pipewright.schedules.schedule_info import ScheduleCosts, ScheduleInfo

_FAMILIES = ("classic", "paired", "zero_bubble", "vshape", "asynchronous", "async_variants")


class ScheduleRegistry(Mapping[str, ScheduleInfo]):
    """Immutable mapping name → :class:`ScheduleInfo`; ``with_schedules`` returns an extended copy."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Iterable[ScheduleInfo] = ()) -> None:
        self._entries: dict[str, ScheduleInfo] = {}
        for entry in entries:
            if entry.name in self._entries:
                raise ScheduleError(f"schedule {entry.name!r} registered twice")
            self._entries[entry.name] = entry

    def __getitem__(self, name: str) -> ScheduleInfo:
        return self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def with_schedules(self, *entries: ScheduleInfo) -> ScheduleRegistry:
        return ScheduleRegistry([*self._entries.values(), *entries])


@cache
def default_registry() -> ScheduleRegistry:
    """The library's schedule families (:data:`_FAMILIES`)."""
    entries: list[ScheduleInfo] = []
    for family in _FAMILIES:
        entries.extend(importlib.import_module(f"pipewright.schedules.{family}").SCHEDULES)
    return ScheduleRegistry(entries)


def schedule_names(
    registry: ScheduleRegistry | None = None, *, distinct_orders: bool = False
) -> tuple[str, ...]:
    """Every registered schedule name, in family order; with ``distinct_orders``, without those that
    repeat another's actions (``order_of``)."""
    table = registry or default_registry()
    return tuple(n for n in table if not (distinct_orders and table[n].order_of))


def info(name: str, registry: ScheduleRegistry | None = None) -> ScheduleInfo:
    table = registry or default_registry()
    try:
        return table[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(table)}") from None


def check_args(
    name: str, p: int, m: int, v: int | None, registry: ScheduleRegistry | None = None
) -> tuple[ScheduleInfo, int]:
    """Resolve the schedule and v, raising a one-line ScheduleError for bad input."""
    entry = info(name, registry)
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


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual: int | None = None,
    *,
    costs: ScheduleCosts | None = None,
    registry: ScheduleRegistry | None = None,
) -> Schedule:
    """Build the named schedule for p = ``stages`` ranks, m = ``microbatches``, v = ``virtual``;
    with ``costs``, a generator that plans with costs (``build_costed``) uses them."""
    entry, v = check_args(name, stages, microbatches, virtual, registry)
    if costs is not None and entry.build_costed is not None:
        return entry.build_costed(stages, microbatches, v, costs)
    return entry.build(stages, microbatches, v)
