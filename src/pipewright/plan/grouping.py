"""Megatron-LM's microbatch group per virtual stage in the planner (``plan --microbatch-group N``).

Interleaved 1F1B sends microbatches through the chunks in groups of N (Megatron-LM's
``--microbatch-group-size-per-virtual-pipeline-stage``, Llama 3 §3.3.2): each group passes chunk 0,
then chunk 1, …, before the next group starts, and rank r runs (p − r − 1)·2 + (v − 1)·N warm-up
forwards. A fixed N applies to every candidate of a schedule that registers ``build_grouped`` (its
``ScheduleInfo.extra``); candidates the schedule's rules refuse with that N (N < p, m < N, a last group
smaller than p) are not generated. Other schedules ignore N. One place for the rule, so the partition's
memory, the simulated order and the plan file agree.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from pipewright.schedules.registry import check_args, info


def grouped(name: str) -> bool:
    """Whether schedule ``name`` groups its microbatches (registers ``build_grouped``)."""
    return "build_grouped" in info(name).extra


def group_for(name: str, group: int | None) -> int | None:
    """The microbatch group schedule ``name`` runs with: ``group`` where it groups, else None."""
    return group if group is not None and grouped(name) else None


def check(name: str, p: int, m: int, v: int, group: int | None = None) -> None:
    """The schedule's rules for (p, m, v) and, where it groups, for N = ``group`` (ScheduleError)."""
    entry, v = check_args(name, p, m, v)
    n = group_for(name, group)
    if n is not None and entry.check is not None:
        entry.check(p, m, v, n)


def in_flight(name: str, p: int, m: int, v: int, group: int | None = None) -> list[float]:
    """Peak activation memory per rank in microbatches (the schedule's formula; with N its grouped
    one: (p − r − 1)·2 + (v − 1)·N + 1 chunk-microbatches of 1/v)."""
    return list(_in_flight(name, p, m, v, group))


@functools.lru_cache(maxsize=256)
def _in_flight(name: str, p: int, m: int, v: int, group: int | None) -> tuple[float, ...]:
    """:func:`in_flight`, once per shape (the V shapes' formula builds the order)."""
    entry, n = info(name), group_for(name, group)
    memory: list[Fraction] = (
        entry.memory(p, m, v) if n is None else entry.extra["memory_grouped"](p, m, v, n)  # type: ignore[operator]
    )
    return tuple(float(x) for x in memory)


def build(name: str, p: int, m: int, v: int, group: int | None = None):
    """The schedule's order, grouped by N where the schedule groups."""
    from pipewright.schedules import build_schedule

    n = group_for(name, group)
    if n is None:
        return build_schedule(name, p, m, v)
    return info(name).extra["build_grouped"](p, m, v, n)  # type: ignore[operator]
