"""The zero-bubble memory limit as a searched schedule parameter (plan/zb_limit.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pipewright.ir import Action, F
from pipewright.models.spec import ModelSpec
from pipewright.plan.mapping import device_order
from pipewright.plan.search import Candidate, Problem, _Context, estimate, simulate_plan
from pipewright.plan.simulated import plan_models
from pipewright.plan.zb_limit import _Order, limit_range, search_limit
from pipewright.schedules import build_schedule
from pipewright.topology import ring


def _instance(memory_limit: float | None = None):
    """Eight A100s in a ring of 25 GbE links, a small-hidden model: the boundary transfers are long next
    to the compute, so running forwards further ahead (a larger limit) hides them."""
    topo = ring(8, "a100-80gb", "eth-25g")
    spec = ModelSpec("s", 16, 1024, 16, 32000, 2048)
    prob = Problem(spec, topo, 16, dtype="bf16", schedules=("zb-h1",), recompute=("none",),
                   microbatch_sizes=(1,), fixed=(1, 8, 1), memory_limit=memory_limit)  # fmt: skip
    ctx = _Context(prob, device_order(topo))
    return prob, simulate_plan(prob, estimate(ctx, Candidate(1, 8, 1, 1, 16, "zb-h1")))


def _dense(prob, ev) -> dict[int, float]:
    lo, hi = limit_range(prob, ev)
    order = _Order(prob, ev)
    out = {}
    for lim in range(lo, hi + 1):
        t = order.simulate(lim)
        out[lim] = t.time if t.fits else math.inf
    return out


@pytest.mark.parametrize("cap", [None, 11.5])
def test_chosen_limit_is_the_best_of_a_dense_grid(cap) -> None:
    prob, ev = _instance()
    if cap is not None:  # device memory that holds at most 11 microbatches in flight on some rank
        (cost, _), ref = plan_models(prob, ev), build_schedule("zb-h1", 8, 16)
        need = [
            cost.static_bytes(r, ref) + cap * cost.activation_bytes(Action(r, F, 0), ref) for r in range(8)
        ]
        prob = replace(prob, memory_limit=max(need))
        ev = simulate_plan(prob, ev)
    dense = _dense(prob, ev)
    best, tried = search_limit(prob, ev)
    assert best is not None and best.candidate.schedule == "zb-auto"
    assert min(dense) == 8 and max(dense) == (16 if cap is None else 11)
    assert dense[8] > 1.05 * min(dense.values())  # the limit matters here
    assert best.time <= 1.01 * min(dense.values())
    assert best.zb_memory_limit in dense and best.time == pytest.approx(dense[best.zb_memory_limit])
    assert len(tried) < len(dense) or len(dense) <= 5  # a search, not the dense grid
    if cap is not None:
        assert best.zb_memory_limit == 11  # the old fixed values (8, 12, 15) held only 8 under this cap
