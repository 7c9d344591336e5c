"""The planner's estimate of orders with several chunks per rank (interleaved 1F1B): the order itself
priced with each chunk's forward and backward time.

The closed form ``(m − 1 + 1/v)·t_max + (Σ_r t_r − t_max)/v`` holds for v = 1. With v > 1 it misses
two things the simulation has (measured 2026-11-26 on unit-cost orders, no communication):

- equal chunks: the order takes ``m·t + (p − 1)·t/v`` (Narayanan et al. 2021, §2.2.1: the bubble
  (p − 1)·t/v), which the closed form underestimates by (1 − 1/v)·t;
- unequal chunks — the planner's partition gives some chunks one more layer (126 layers on p = 16,
  v = 6: chunks of 1 and 2 layers), and the first and last chunks hold the embedding and the output
  layer: each group of microbatches passes the chunks in turn, and a rank whose next chunk is longer
  than the one feeding it stalls every group, so the bubble grows with m (p = 4, v = 2, chunks of 1 and
  2 layers, backward 2 × forward: 21, 24, 27 forward-layer units over m = 8, 12, 16, against a
  constant 13.5 for equal chunks of the same total).

So the estimate runs the schedule's order (built once per (p, m, v, N)) through the list-scheduling
model of :func:`pipewright.schedules.estimate.order_makespan`: chunk c's forward ``f[c]`` and backward
``b[c]`` seconds, one boundary transfer per hop between ranks. Orders of more than ``MAX_ACTIONS``
actions are priced on the fewest whole groups that repeat (two and three) and extrapolated per group:
beyond the first group the bubble grows by the same amount each group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipewright.ir import Action, B, F, I
from pipewright.plan import grouping
from pipewright.schedules.estimate import order_makespan
from pipewright.schedules.registry import ScheduleCosts

#: Actions above which the order is priced on two and three groups and extrapolated.
MAX_ACTIONS = 4096


@functools.lru_cache(maxsize=64)
def _order(name: str, p: int, m: int, v: int, group: int | None):
    """(per-rank action rows, stage placement) of the schedule's order, built once per shape."""
    sched = grouping.build(name, p, m, v, group)
    rows: tuple[tuple[Action, ...], ...] = sched.actions
    return rows, sched.placement


def order_placement(name: str, p: int, m: int, v: int, group: int | None = None) -> tuple[int, ...]:
    """The rank of each stage (chunk) in the schedule's order (interleaved: c mod p; V shapes: i and
    2p − 1 − i on rank i)."""
    return tuple(_order(name, p, m, v, group)[1])


def chunked_time(
    name: str,
    p: int,
    m: int,
    v: int,
    group: int | None,
    f: Sequence[float],
    b: Sequence[float],
    comm: float = 0.0,
) -> float:
    """Seconds of schedule ``name``'s order with chunk (stage) c's forward ``f[c]`` and backward
    ``b[c]`` (p·v each) and ``comm`` per transfer between ranks (module docstring). Cached: candidates
    that differ only where the times do not (recomputation with flash attention, optimizer sharding,
    mapping on a symmetric cluster) are priced once."""
    return _chunked_time(name, p, m, v, group, tuple(f), tuple(b), comm)


@functools.lru_cache(maxsize=4096)
def _chunked_time(
    name: str,
    p: int,
    m: int,
    v: int,
    group: int | None,
    f: tuple[float, ...],
    b: tuple[float, ...],
    comm: float,
) -> float:
    costs = ScheduleCosts(f, b, (0.0,) * len(b), comm)
    n = group or p  # microbatches per group
    if 2 * p * m * v <= MAX_ACTIONS or m % n or m <= 3 * n:
        return order_makespan(*_order(name, p, m, v, group), costs)
    two, three = (order_makespan(*_order(name, p, k * n, v, group), costs) for k in (2, 3))
    return three + (m // n - 3) * (three - two)


@functools.lru_cache(maxsize=256)
def end_chunks_in_flight(name: str, p: int, m: int, v: int, group: int | None = None) -> tuple[int, int]:
    """(embedding, head): the most microbatches the order holds between the forward and the
    input-gradient backward (I, or B) of its first chunk and of its last chunk — what the embedding's
    and the output layer's activations (the logits) are held for. 1F1B: (p, 1), what the schedule's
    in-flight count of the first and last ranks gives; interleaved orders and zero-bubble orders hold
    fewer of the last chunk (it runs its backward right after its forward) than the last rank's
    in-flight count of all its chunks and deferred W."""
    rows, placement = _order(name, p, m, v, group)
    last = len(placement) - 1
    out = []
    for stage in (0, last):
        held = most = 0
        for a in rows[placement[stage]]:
            if a.stage != stage:
                continue
            if a.kind == F:
                held += 1
                most = max(most, held)
            elif a.kind in (I, B):
                held -= 1
        out.append(most)
    return out[0], out[1]


def exposed_reduction(p: int, backward: Sequence[float], reduction: Sequence[float]) -> float:
    """Seconds the first rank's gradient reductions run past its last backward, with v chunks per rank:
    chunk j's reduction (``reduction[j]`` seconds) starts when its last backward ends — the last group
    still runs p backwards of each chunk k < j after it (``backward[k]`` seconds each) — and after the
    reduction before it on the same link (chunks v − 1, …, 0 in turn); only what runs past the end is
    exposed (v = 1: all of it)."""
    clock, ends = float("-inf"), 0.0
    v = len(backward)
    for j in range(v - 1, -1, -1):
        ends = -p * sum(backward[:j])  # chunk j's last backward, before the end of the last one
        clock = max(clock, ends) + reduction[j]
    return max(clock, 0.0)
