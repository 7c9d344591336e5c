"""The planner's estimate of every schedule: its order itself priced with each chunk's forward (F),
backward (B) and, where the order splits the backward, input-gradient (I) and weight-gradient (W)
seconds, one boundary transfer per hop between ranks, and each chunk's gradient reduction.

Closed forms miss what the simulation has (measured 2026-11-26, docs/planner.md, "How the estimate is
computed"; ``tools/plan_estimate_grid.py``):

- one chunk per rank, ``m·t_max + (Σ_r t_r − t_max)·φ`` (φ = 1 for 1F1B, T_F/(T_F + T_B) for ZB-H1):
  the transfers on the critical path (2(p − 1) hops in 1F1B's first microbatch), and in ZB-H1 the W
  passes deferred past the bubble — 0.92–1.01 of the simulation on the grid, 0.947 on the Llama 3
  405B plan (p = 64);
- several chunks per rank, equal chunks: the order takes ``m·t + (p − 1)·t/v`` (Narayanan et al.
  2021, §2.2.1), which ``(m − 1 + 1/v)·t_max + (Σ_r t_r − t_max)/v`` underestimates by (1 − 1/v)·t;
- unequal chunks — the planner's partition gives some chunks one more layer, and the first and last
  chunks hold the embedding and the output layer: each group of microbatches passes the chunks in
  turn, and a rank whose next chunk is longer than the one feeding it stalls every group, so the
  bubble grows with m (p = 4, v = 2, chunks of 1 and 2 layers, backward 2 × forward: 21, 24, 27
  forward-layer units over m = 8, 12, 16, against a constant 13.5 for equal chunks of the same total);
- orders that run I and W apart (ZB-H1/H2, ZB-V, DualPipeV) priced with W inside B: a stage's
  successor waits for I only, so this was 1.01–1.19 of the simulation for the V shapes.

So the estimate runs the schedule's order (built and compiled once per (p, m, v, N),
:mod:`pipewright.plan.order_time`) in the list-scheduling model of
:func:`pipewright.schedules.estimate.order_makespan`; with constant transfer times it equals the
simulator's makespan. Orders of more than ``MAX_ACTIONS`` actions are priced on the fewest whole
groups that repeat (two and three) and extrapolated per group: beyond the first group the bubble
grows by the same amount each group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipewright.ir import Action, B, F, I
from pipewright.plan import grouping
from pipewright.plan.order_time import CompiledOrder, compile_order, priced

#: Actions above which the order is priced on two and three groups and extrapolated.
MAX_ACTIONS = 4096


@functools.lru_cache(maxsize=64)
def _order(name: str, p: int, m: int, v: int, group: int | None):
    """(per-rank action rows, stage placement) of the schedule's order, built once per shape."""
    sched = grouping.build(name, p, m, v, group)
    rows: tuple[tuple[Action, ...], ...] = sched.actions
    return rows, sched.placement


@functools.lru_cache(maxsize=64)
def _compiled(name: str, p: int, m: int, v: int, group: int | None) -> CompiledOrder:
    """The order compiled for pricing (:mod:`pipewright.plan.order_time`), once per shape."""
    return compile_order(*_order(name, p, m, v, group))


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
    split: tuple[Sequence[float], Sequence[float]] | None = None,
    reductions: Sequence[float] | None = None,
) -> float:
    """Seconds of schedule ``name``'s order with chunk (stage) c's forward ``f[c]`` and backward
    ``b[c]`` (p·v each), ``comm`` per transfer between ranks and, for orders that run the backward as
    an input-gradient pass I and a weight-gradient pass W, ``split`` = (I, W) seconds per chunk
    (default: I the whole backward, W nothing) (module docstring). Any schedule, one chunk per rank or
    several. ``reductions``: each chunk's gradient reduction seconds (:func:`reduced_end`). Cached:
    candidates that differ only where the times do not (recomputation with flash attention,
    optimizer sharding, mapping on a symmetric cluster) are priced once."""
    i, w = (tuple(b), (0.0,) * len(b)) if split is None else (tuple(split[0]), tuple(split[1]))
    makespan, ends = _chunked_time(name, p, m, v, group, tuple(f), tuple(b), i, w, comm)
    if reductions is None:
        return makespan
    return reduced_end(makespan, ends, order_placement(name, p, m, v, group), reductions)


@functools.lru_cache(maxsize=4096)
def _chunked_time(
    name: str,
    p: int,
    m: int,
    v: int,
    group: int | None,
    f: tuple[float, ...],
    b: tuple[float, ...],
    i: tuple[float, ...],
    w: tuple[float, ...],
    comm: float,
) -> tuple[float, tuple[float, ...]]:
    """(makespan, each chunk's last backward's end), extrapolated per group beyond three groups."""
    n = group or p  # microbatches per group
    if 2 * p * m * v <= MAX_ACTIONS or m % n or m <= 3 * n:
        makespan, ends = priced(_compiled(name, p, m, v, group), f, i, w, comm, b)
        return makespan, tuple(ends.tolist())
    (two, ends2), (three, ends3) = (
        priced(_compiled(name, p, k * n, v, group), f, i, w, comm, b) for k in (2, 3)
    )
    more = m // n - 3
    return three + more * (three - two), tuple((ends3 + more * (ends3 - ends2)).tolist())


def reduced_end(
    makespan: float, ends: Sequence[float], placement: Sequence[int], reductions: Sequence[float]
) -> float:
    """When the iteration ends with every chunk's gradient reduction: chunk c's (``reductions[c]``
    seconds) starts when its last backward ends (``ends[c]``) and after the reduction before it on
    the same rank (one data-parallel link per rank, taken in the order the backwards end, as
    :func:`~pipewright.passes.grad_reduce.add_grad_reduction` places them and the simulator runs
    them); the iteration ends at the later of the last compute action and the last reduction."""
    clock: dict[int, float] = {}
    for c in sorted(range(len(ends)), key=lambda c: (placement[c], ends[c])):
        r = placement[c]
        clock[r] = max(clock.get(r, float("-inf")), ends[c]) + reductions[c]
    return max(makespan, *clock.values())


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
