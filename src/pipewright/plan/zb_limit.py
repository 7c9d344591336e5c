"""A microbatch order fitted to the plan's stage times: Zero Bubble's memory-bounded greedy, with its
memory limit searched as a schedule parameter.

Qi et al.'s automatic zero-bubble schedule (:func:`pipewright.schedules.zero_bubble.zb_auto`) orders
each rank's F, I and W passes greedily under a cap L on the microbatches a rank keeps in flight. L = p
holds what 1F1B holds (ZB-H1-like orders); a larger L lets the greedy run forwards further ahead and
fill more of the bubble, up to the unconstrained L = m (every microbatch may be in flight), at the cost
of L microbatches' activations. The planner's L ranges over the integers

    L ∈ [p, min(m, L_mem)],   L_mem = min over ranks r of ⌊(device memory − static bytes of r) / A_r⌋

(A_r: the activation bytes one microbatch of rank r's chunk stores), so every L it tries fits. The
simulated iteration time T(L) is not unimodal in general (the greedy is a heuristic), so the search is
a grid refined around its best point: evaluate ``points`` evenly spaced L (both ends included), then
the same number of points between the best one's neighbours, until neighbours are one apart. Ties go
to the smaller L (less memory). O(points · log_points(range)) simulations, each O(p·m) lowered
actions; at most ``budget`` in all. With ``Problem.zb_refine_seconds`` the best L's order is refined by
the paper's integer linear program (:mod:`pipewright.schedules.zb_ilp`) and kept where faster.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipewright.ir import SEND_F, Action, F, I, W
from pipewright.plan.problem import Evaluated, Problem
from pipewright.plan.simulated import device_memory_limit, plan_models, rank_device, simulate_plan


def limit_range(prob: Problem, ev: Evaluated) -> tuple[int, int]:
    """(p, min(m, L_mem)): the memory limits worth trying for ``ev`` (module docstring); the upper end
    is below p when even 1F1B's limit does not fit."""
    c = ev.candidate
    p, m = c.pp, c.microbatches
    cost, _ = plan_models(prob, ev)
    ref = _reference(p, m)
    room = []
    for r in range(p):
        act = cost.activation_bytes(Action(r, F, 0), ref)
        limit = device_memory_limit(prob, [rank_device(ev, r)]) - cost.static_bytes(r, ref)
        room.append(math.floor(limit / act) if act > 0 else m)
    return min(p, m), min(m, *room)


def _reference(p: int, m: int):
    from pipewright.schedules import build_schedule

    return build_schedule("zb-h1", p, m)


def _grid(lo: int, hi: int, points: int) -> list[int]:
    """``points`` integers spread evenly over [lo, hi], both ends included (all of them if fewer)."""
    if hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    return sorted({lo + round(k * (hi - lo) / (points - 1)) for k in range(points)})


def search_limit(
    prob: Problem, ev: Evaluated, points: int = 5, budget: int = 24
) -> tuple[Evaluated | None, dict[int, float]]:
    """The zb-auto order for ``ev``'s partition and devices with the best memory limit L (module
    docstring), and every L tried with its simulated time (inf: did not fit in simulation). None when
    the plan is not a one-chunk pipeline or no L fits."""
    c = ev.candidate
    if c.virtual > 1 or c.pp == 1:
        return None, {}
    lo, hi = limit_range(prob, ev)
    if hi < lo:
        return None, {}
    order = _Order(prob, ev)
    tried: dict[int, Evaluated] = {}

    def time(lim: int) -> float:
        if lim not in tried:
            tried[lim] = order.simulate(lim)
        t = tried[lim]
        return t.time if t.fits else math.inf

    a, b = lo, hi
    while len(tried) < budget:
        fresh = [x for x in _grid(a, b, points) if x not in tried][: budget - len(tried)]
        for lim in fresh:
            time(lim)
        known = sorted(x for x in tried if a <= x <= b)
        k = known.index(min(known, key=lambda x: (time(x), x)))
        a, b = known[max(k - 1, 0)], known[min(k + 1, len(known) - 1)]
        if not fresh or all(x in tried for x in range(a, b + 1)):
            break
    times = {lim: time(lim) for lim in sorted(tried)}
    best = min(times, key=lambda x: (times[x], x))
    return (tried[best] if math.isfinite(times[best]) else None), times


class _Order:
    """Builds and simulates zb-auto orders of one plan from its per-stage F, I, W and transfer times."""

    def __init__(self, prob: Problem, ev: Evaluated) -> None:
        c = ev.candidate
        p, m = c.pp, c.microbatches
        self.prob, self.ev = prob, ev
        cost, comm = plan_models(prob, ev)
        ref = _reference(p, m)
        self.f = [cost.compute_time(Action(s, F, 0), ref) for s in range(p)]
        self.i = [cost.compute_time(Action(s, I, 0), ref) for s in range(p)]
        self.w = [cost.compute_time(Action(s, W, 0), ref) for s in range(p)]
        nbytes = cost.message_bytes(Action(0, SEND_F, 0), ref)
        self.comm = max(comm.p2p_time(r, r + 1, nbytes) for r in range(p - 1))

    def simulate(self, limit: int, refine: float | None = None) -> Evaluated:
        from pipewright.schedules.zero_bubble import zb_auto

        ev = self.ev
        c = ev.candidate
        sched = zb_auto(c.pp, c.microbatches, f=self.f, i=self.i, w=self.w, comm=self.comm,
                        memory_limit=limit, refine_time_limit=refine)  # fmt: skip
        t = Evaluated(replace(c, schedule="zb-auto"), ev.chunk_layers, ev.devices, ev.estimate, ev.bottleneck,
                      schedule=sched, zb_memory_limit=limit)  # fmt: skip
        return simulate_plan(self.prob, t)


def cost_aware_order(prob: Problem, ev: Evaluated) -> list[Evaluated]:
    """Where stage times differ, a microbatch order fitted to them instead of a fixed template: the
    zb-auto order with the searched memory limit (:func:`search_limit`); [] when none applies. The
    budget shrinks with the schedule's size as the refinement's does (about 2·10⁵ microbatches
    simulated; at least the first grid of 5)."""
    c = ev.candidate
    budget = max(5, min(24, 200_000 // (c.pp * c.microbatches)))
    best, _ = search_limit(prob, ev, budget=budget)
    if best is None:
        return []
    if prob.zb_refine_seconds is not None:  # the ILP refinement of the best limit's order, if faster
        refined = _Order(prob, ev).simulate(best.zb_memory_limit, prob.zb_refine_seconds)
        if refined.fits and refined.time < best.time:
            best = refined
    return [best]
