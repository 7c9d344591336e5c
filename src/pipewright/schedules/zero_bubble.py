"""Zero-bubble schedules (Qi, Wan, Huang, Lin: Zero Bubble Pipeline Parallelism, ICLR 2024).

The backward splits into I (gradient to the input, on the critical path) and W (gradient to the
weights, which nothing downstream waits for), so W can fill the pipeline bubbles. Bubbles, with the
per-stage times T_F, T_I (the paper's T_B) and T_W:

- 1F1B:  (p − 1)(T_F + T_I + T_W)
- ZB-H1: (p − 1)(T_F + T_I − T_W), at 1F1B's peak memory (p microbatches in flight)
- ZB-H2: zero in steady state, with up to 2p − 1 microbatches in flight; the iteration boundary
  then has no optimizer barrier (the paper's post-validation of the optimizer step).

Memory here is :func:`pipewright.ir.peak_in_flight`: F adds a microbatch, W (or B) frees it, I frees
nothing. The paper frees most of the activation at I and counts the W remainder as smaller; in this
coarser model delaying W keeps the whole microbatch alive, so ZB-H1 holds min(p, m) on every rank
(1F1B's rank 0 peak; 1F1B's rank r holds p − r).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from fractions import Fraction

from pipewright.errors import ScheduleError, ValidationError
from pipewright.ir import Action, F, I, Schedule, W, loop_placement, peak_in_flight
from pipewright.schedules.estimate import order_times
from pipewright.schedules.schedule_info import ScheduleCosts, ScheduleInfo
from pipewright.schedules.zb_greedy import StageCosts, all_orders


def _schedule(name: str, p: int, m: int, rows: Iterable[Iterable[Action]], **meta: object) -> Schedule:
    return Schedule.build(name, m, rows, loop_placement(p), **meta)


def _with_delayed_weights(rank: int, forwards_and_inputs: list[Action], delay: int) -> list[Action]:
    """Insert W(k) right after the (k + delay)-th I of the order; the last ``delay`` W run at the end."""
    out: list[Action] = []
    done_i = 0
    next_w = 0
    for a in forwards_and_inputs:
        out.append(a)
        if a.kind == I:
            done_i += 1
            if done_i > delay:
                out.append(Action(rank, W, next_w))
                next_w += 1
    out += [Action(rank, W, k) for k in range(next_w, done_i)]
    return out


def _delayed_1f1b(name: str, p: int, m: int, warmup: list[int], delay: list[int], **meta: object) -> Schedule:
    """Rank r: ``warmup[r]`` forwards, then F, I pairs, then the remaining I; W runs ``delay[r]`` backward
    steps after its I (:func:`_with_delayed_weights`)."""
    rows = []
    for r in range(p):
        warm = min(warmup[r], m)
        order = [Action(r, F, k) for k in range(warm)]
        for k in range(m - warm):
            order += [Action(r, F, warm + k), Action(r, I, k)]
        order += [Action(r, I, k) for k in range(m - warm, m)]
        rows.append(_with_delayed_weights(r, order, delay[r]))
    return _schedule(name, p, m, rows, **meta)


def _handcrafted_h1(p: int, m: int) -> Schedule:
    return _delayed_1f1b("zb-h1", p, m, [p - 1 - r for r in range(p)], list(range(p)))


def _handcrafted_h2(p: int, m: int) -> Schedule:
    return _delayed_1f1b(
        "zb-h2",
        p,
        m,
        [2 * (p - 1 - r) for r in range(p)],
        [2 * r for r in range(p)],
        needs_post_validation=True,
    )


def _unit(p: int) -> ScheduleCosts:
    return ScheduleCosts((1.0,) * p, (1.0,) * p, (1.0,) * p)


def _greedy(p: int, m: int, costs: ScheduleCosts, limit: int) -> list[tuple[str, list[list[Action]]]]:
    stage = StageCosts(costs.f, costs.i, costs.w, costs.comm)
    return [("greedy", orders) for orders, _ in all_orders(p, m, stage, limit)]


def _fastest(
    name: str,
    p: int,
    m: int,
    costs: ScheduleCosts,
    options: Sequence[tuple[str, Sequence[Sequence[Action]]]],
    *,
    steady: bool = False,
    **meta: object,
) -> Schedule:
    """The option with the least :func:`~pipewright.schedules.estimate.order_makespan` under ``costs``
    — with ``steady``, the least :func:`~pipewright.schedules.estimate.order_span` (the period without
    an optimizer barrier, which a schedule that needs post-validation runs with), makespan second — ties:
    the first; ``meta["order"]`` names where it came from, ``meta["estimated_makespan"]`` its makespan."""
    placement = loop_placement(p)
    scored = []
    for n, (_, rows) in enumerate(options):
        makespan, span = order_times(rows, placement, costs)
        scored.append(((span, makespan) if steady else (makespan,), makespan, n))
    _, best, n = min(scored)
    label, rows = options[n]
    return _schedule(name, p, m, rows, order=label, estimated_makespan=best, **meta)


def _h1_options(p: int, m: int, costs: ScheduleCosts) -> list[tuple[str, Sequence[Sequence[Action]]]]:
    return [("handcrafted", _handcrafted_h1(p, m).actions), *_greedy(p, m, costs, p)]


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1, the handcrafted schedule of Qi et al. 2024 (torch's ScheduleInterleavedZeroBubble with one
    chunk builds the same order).

    Rank r runs 1F1B's order with I in place of B — p − 1 − r warm-up forwards, then F, I pairs, then
    the remaining I — and runs each W r backward steps after its I (the last r W at the end). The
    delayed W fill the bubbles where a rank waits for gradients: bubble (p − 1)(T_F + T_I − T_W) for
    T_W ≤ T_F, T_I (with larger T_W it stays at the pipeline fill (p − 1)·T_F); with
    unit costs one iteration takes 3m + p − 1 (1F1B: 3m + 3(p − 1)) for m ≥ p. Peak memory min(p, m)
    on every rank (see the module docstring). With costs see :func:`zb_h1_costed`.
    """
    return _handcrafted_h1(p, m)


def zb_h1_costed(p: int, m: int, v: int, costs: ScheduleCosts) -> Schedule:
    """ZB-H1 under the caller's costs, with communication: as the paper's reference code builds its
    1p schedule, the automatic scheduler at 1F1B's memory (limit p), or the handcrafted order when that
    is faster under ``costs`` (:func:`_fastest`). Peak min(p, m) on every rank or less."""
    return _fastest("zb-h1", p, m, costs, _h1_options(p, m, costs))


def _h2_options(p: int, m: int, costs: ScheduleCosts) -> list[tuple[str, Sequence[Sequence[Action]]]]:
    return [
        ("handcrafted", _handcrafted_h2(p, m).actions),
        ("zb-h1 (faster at this m)", _handcrafted_h1(p, m).actions),
    ]


def zb_h2(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H2, the handcrafted schedule of Qi et al. 2024: twice ZB-H1's warm-up and W delay.

    Rank r runs 2(p − 1 − r) warm-up forwards, then F, I pairs, then the remaining I, and each W 2r
    backward steps after its I. Rank 0 thus starts with 2p − 1 forwards, the extra forwards fill the
    bubble before the first backward and the delayed W reorder the tail into a parallelogram: rank r
    idles only r time units before its first F and p − 1 − r after its last W. With unit costs one
    iteration takes 3m + p − 1 for m ≥ 2p − 2 and iterations without an optimizer barrier follow each
    other every 3m: zero bubble in steady state. That needs the paper's post-validation (each stage
    steps its optimizer without a global synchronisation, a later check rolls back on inf/NaN or
    clipping): ``meta["needs_post_validation"]``. Peak memory min(2p − 1, m) on every rank.

    With few microbatches the long warm-up does not pay (p = 8, m = 8: 34 against ZB-H1's 31), so the
    order is ZB-H1's whenever that is faster with unit costs (``meta["order"]`` says which); ZB-H2 is
    never slower than ZB-H1.
    """
    return _fastest("zb-h2", p, m, _unit(p), _h2_options(p, m, _unit(p)), needs_post_validation=True)


def zb_h2_costed(p: int, m: int, v: int, costs: ScheduleCosts) -> Schedule:
    """ZB-H2 under the caller's costs, with communication: the fastest of the handcrafted order, ZB-H1's
    candidates (:func:`zb_h1_costed`) and the automatic scheduler at ZB-H2's memory (limit 2p, the
    reference code's 2p schedule), so never slower than ``zb-h1`` under the same costs."""
    options = [*_h2_options(p, m, costs), *_h1_options(p, m, costs)[1:], *_greedy(p, m, costs, 2 * p)]
    return _fastest("zb-h2", p, m, costs, options, steady=True, needs_post_validation=True)


def zb_auto(
    p: int,
    m: int,
    *,
    f: Sequence[float],
    i: Sequence[float],
    w: Sequence[float],
    comm: float = 0.0,
    memory_limit: float | None = None,
    refine_time_limit: float | None = None,
) -> Schedule:
    """The automatic zero-bubble schedule (Qi et al. 2024, §3.1): the memory-bounded greedy of
    :mod:`pipewright.schedules.zb_greedy` with per-stage costs ``f``, ``i``, ``w`` (length p, > 0),
    point-to-point time ``comm`` and at most ``memory_limit`` microbatches in flight per rank (default
    2p − 1, ZB-H2-like; p gives ZB-H1-like orders).

    The heuristic runs once per fill choice; every resulting order — and the handcrafted ZB-H1 and ZB-H2
    where their peak fits the limit — is scored under the same costs
    (:func:`~pipewright.schedules.estimate.order_makespan`) and the fastest is kept, so zb-auto is never
    slower than ZB-H1 at limit p nor than ZB-H2 at limit 2p − 1 or more. ``meta["estimated_makespan"]``
    is that score, ``meta["order"]`` where the order came from.

    With ``refine_time_limit`` (seconds), the paper's refinement follows: an integer linear program over
    the order, started from the fastest candidate (:func:`pipewright.schedules.zb_ilp.refine`); its order
    replaces the candidate only when it scores strictly better, at the same memory limit
    (``meta["ilp"]``: the start's and the result's score, solves, seconds). Without scipy (the
    ``pipewright[ilp]`` extra) one line is logged and the heuristic's order is kept.
    """
    if p < 1 or m < 1:
        raise ScheduleError(f"zb-auto needs at least 1 stage and 1 microbatch (got p={p}, m={m})")
    for label, costs in (("f", f), ("i", i), ("w", w)):
        if len(costs) != p or any(c <= 0 for c in costs):
            raise ScheduleError(
                f"zb-auto: give {p} positive {label} costs, one per stage (got {list(costs)})"
            )
    if comm < 0:
        raise ScheduleError(f"zb-auto: comm must be at least 0 (got {comm})")
    limit = 2 * p - 1 if memory_limit is None else math.floor(memory_limit)
    if limit < 1:
        raise ScheduleError(
            f"zb-auto: memory_limit {memory_limit} holds no microbatch; give at least 1 (microbatches)"
        )
    costs = ScheduleCosts(tuple(f), tuple(i), tuple(w), comm)
    options = _greedy(p, m, costs, limit)
    if limit > p:  # ZB-1p's orders fit a larger limit too (the candidates of zb-h2 at 2p)
        options += _greedy(p, m, costs, p)
    for label, sched in (("zb-h1", _handcrafted_h1(p, m)), ("zb-h2", _handcrafted_h2(p, m))):
        if max(peak_in_flight(sched)) <= limit:
            options.append((label, sched.actions))
    steady = limit >= 2 * p - 1  # ZB-2p-like: the paper runs it with post-validation
    meta = {"needs_post_validation": True} if steady else {}
    best = _fastest("zb-auto", p, m, costs, options, steady=steady, memory_limit=limit, **meta)
    if refine_time_limit is None:
        return best
    if refine_time_limit <= 0:
        raise ScheduleError(f"zb-auto: the ILP time limit must be positive (got {refine_time_limit} s)")
    return _refined(best, p, m, costs, limit, steady, refine_time_limit)


def _refined(
    best: Schedule, p: int, m: int, costs: ScheduleCosts, limit: int, steady: bool, seconds: float
) -> Schedule:
    """``best`` or the ILP refinement of its order, whichever scores better (:func:`zb_auto`)."""
    from pipewright.schedules import zb_ilp

    if not zb_ilp.scipy_available():
        logging.getLogger(__name__).warning(
            "zb-auto: scipy is not installed (pip install 'pipewright[ilp]'); kept the heuristic's order"
        )
        return best
    done = zb_ilp.refine(p, m, costs, limit, best.actions, time_limit=seconds, steady=steady)
    report = {
        "start": done.start_score,
        "result": done.score,
        "solves": done.solves,
        "seconds": round(done.seconds, 3),
        "window": done.window,
        "proven": done.proven,
    }
    if done.rows is None:
        return replace(best, meta={**best.meta, "ilp": report})
    meta = {**best.meta, "order": f"ilp refinement of {best.meta['order']}", "ilp": report}
    meta["estimated_makespan"] = done.score[-1]
    refined = _schedule("zb-auto", p, m, done.rows, **{k: v for k, v in meta.items() if k != "flush"})
    from pipewright.passes import validate

    try:
        return validate(refined)
    except ValidationError as exc:  # not expected: the ILP's constraints are the dependencies
        logging.getLogger(__name__).warning(
            "zb-auto: the ILP's order does not validate (%s)", str(exc).split("\n")[0]
        )
        return replace(best, meta={**best.meta, "ilp": report})


def _zb_auto_unit(p: int, m: int, v: int = 1) -> Schedule:
    """The registry's zb-auto without costs: unit costs (F = I = W = 1, free communication), memory
    limit p."""
    return zb_auto(p, m, f=[1.0] * p, i=[1.0] * p, w=[1.0] * p, memory_limit=p)


def _zb_auto_costed(p: int, m: int, v: int, costs: ScheduleCosts) -> Schedule:
    """The registry's zb-auto with the caller's costs (from a cost model or a profile); memory limit
    ``costs.memory_limit`` or p (1F1B's)."""
    limit = p if costs.memory_limit is None else costs.memory_limit
    # stages with no work (an empty cost) still need a positive cost for the greedy's ordering
    tiny = 1e-9 * max((*costs.f, *costs.i, *costs.w, 1e-9))
    f, i, w = ([max(t, tiny) for t in ts] for ts in (costs.f, costs.i, costs.w))
    return zb_auto(
        p, m, f=f, i=i, w=w, comm=costs.comm, memory_limit=limit, refine_time_limit=costs.refine_time_limit
    )


def _same_on_every_rank(peak: Callable[[int, int], int]) -> Callable[[int, int, int], list[Fraction]]:
    return lambda p, m, v: [Fraction(peak(p, m))] * p


SCHEDULES = (
    ScheduleInfo(
        name="zb-h1",
        build=zb_h1,
        build_costed=zb_h1_costed,
        memory=_same_on_every_rank(lambda p, m: min(p, m)),
        bubble="(p − 1)(T_F + T_I − T_W)",
        memory_formula="min(p, m) on every rank",
        source="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (ZB-H1)",
    ),
    ScheduleInfo(
        name="zb-h2",
        build=zb_h2,
        build_costed=zb_h2_costed,
        memory=lambda p, m, v: peak_in_flight(zb_h2(p, m)),
        bubble="0 in steady state (no optimizer barrier; one iteration alone: (p − 1)·T_F with unit costs)",
        memory_formula="min(2p − 1, m) on every rank (min(p, m) where ZB-H1's order is faster)",
        source="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (ZB-H2)",
    ),
    ScheduleInfo(
        name="zb-auto",
        build=_zb_auto_unit,
        build_costed=_zb_auto_costed,
        memory=_same_on_every_rank(lambda p, m: min(p, m)),
        bubble="greedy, ILP-refined with --zb-refine; with unit costs and memory limit p as ZB-H1: "
        "(p − 1)(T_F + T_I − T_W)",
        memory_formula="at most the memory limit (p in the registry), min(p, m) with unit costs",
        source="Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (automatic scheduling)",
    ),
)
