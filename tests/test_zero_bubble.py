"""Zero-bubble schedules: ZB-H1, ZB-H2 and the automatic greedy (Qi et al., ICLR 2024)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _unit_makespan import UNIT, ConstComm, steady_period, unit_makespan
from pipewright.cost.unit import StageTimes
from pipewright.errors import ScheduleError
from pipewright.ir import F, peak_in_flight
from pipewright.passes import lower, validate
from pipewright.schedules import ScheduleCosts, build_schedule, info
from pipewright.schedules.zero_bubble import zb_auto
from pipewright.sim import simulate

NAMES = ("zb-h1", "zb-h2", "zb-auto")
CASES = [(p, m) for p in range(2, 9) for m in (p, 2 * p, 4 * p)] + [(3, 5), (4, 7), (5, 13), (8, 9)]


@pytest.mark.parametrize("name", NAMES)
def test_valid_lowered_and_memory_formula(name: str) -> None:
    for p, m in CASES:
        sched = build_schedule(name, p, m)
        validate(sched)
        validate(lower(sched))
        assert peak_in_flight(sched) == info(name).memory(p, m, 1), (name, p, m)
        assert {a.kind for row in sched.actions for a in row} == {"F", "I", "W"}


def _ideal(m: int, c: dict[str, float]) -> float:
    return m * (c["F"] + c["I"] + c["W"])


@pytest.mark.parametrize(
    "costs",
    [
        UNIT,
        {"F": 2, "I": 2, "W": 1, "B": 3},
        {"F": 3, "I": 2, "W": 2, "B": 4},
        {"F": 1, "I": 1, "W": 0.5, "B": 1.5},
    ],
    ids=str,
)
def test_zb_h1_bubble_formula(costs: dict[str, float]) -> None:
    """1F1B's bubble (p − 1)(F + B) with B = I + W shrinks to (p − 1)(F + I − W) in ZB-H1."""
    for p in range(2, 9):
        for m in (p, 2 * p, 4 * p):
            one_f_one_b = unit_makespan(build_schedule("1f1b", p, m), costs)
            zb = unit_makespan(build_schedule("zb-h1", p, m), costs)
            assert one_f_one_b == _ideal(m, costs) + (p - 1) * (costs["F"] + costs["B"])
            assert zb == _ideal(m, costs) + (p - 1) * (costs["F"] + costs["I"] - costs["W"])


def test_zb_h2_parallelogram_and_zero_steady_state_bubble() -> None:
    for p in range(2, 9):
        for m in (2 * p, 4 * p, 3 * p + 1):
            sched = build_schedule("zb-h2", p, m)
            assert sched.meta["needs_post_validation"] and sched.meta["flush"]
            assert [a.kind for a in sched.actions[0][: 2 * p]] == [F] * (2 * p - 1) + ["I"]
            # one iteration alone: only the fill and drain of the parallelogram, (p − 1)·T_F
            assert unit_makespan(sched) == 3 * m + p - 1
            # iterations without an optimizer barrier: every rank is busy all the time
            assert steady_period(sched) == 3 * m


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_auto_respects_memory_limit(p: int) -> None:
    costs = {
        "f": [1.0 + 0.25 * (r % 3) for r in range(p)],
        "i": [1.5] * p,
        "w": [0.5 + 0.5 * (r % 2) for r in range(p)],
    }
    for m in (p, 2 * p + 1, 4 * p):
        for limit in (1, 2, p / 2, p, 1.5 * p, 2 * p - 1):
            if limit < 1:
                continue
            sched = zb_auto(p, m, **costs, comm=0.1, memory_limit=limit)
            validate(lower(sched))
            assert max(peak_in_flight(sched)) <= limit, (p, m, limit)


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 6),
    extra=st.integers(0, 12),
    costs=st.lists(st.sampled_from([0.25, 1.0, 1.5, 3.0]), min_size=18, max_size=18),
    comm=st.sampled_from([0.0, 0.1, 2.0]),
    limit=st.sampled_from([1, 1.5, 2, 5, None]),
)
def test_zb_auto_any_costs_valid_within_memory(p, extra, costs, comm, limit) -> None:
    m = p + extra
    f, i, w = costs[:p], costs[6 : 6 + p], costs[12 : 12 + p]
    sched = zb_auto(p, m, f=f, i=i, w=w, comm=comm, memory_limit=limit)
    validate(lower(sched))
    assert max(peak_in_flight(sched)) <= (2 * p - 1 if limit is None else int(limit))


def test_zb_auto_with_2p_minus_1_is_zb_h2_like() -> None:
    for p in range(2, 9):
        m = 3 * p
        ones = [1.0] * p
        sched = zb_auto(p, m, f=ones, i=ones, w=ones, memory_limit=2 * p - 1)
        h2 = build_schedule("zb-h2", p, m)
        # warm-up with as many F as memory allows, as ZB-H2: 2p − 1 forwards before rank 0's first I
        assert [a.kind for a in sched.actions[0][: 2 * p]] == [F] * (2 * p - 1) + ["I"]
        assert max(peak_in_flight(sched)) == 2 * p - 1
        assert sched.meta["estimated_makespan"] == unit_makespan(sched) == unit_makespan(h2)
        assert steady_period(sched) == steady_period(h2) == 3 * m


def test_zb_auto_registry_entry_is_zb_h1_like() -> None:
    for p in range(2, 9):
        for m in (p, 2 * p, 4 * p):
            sched = build_schedule("zb-auto", p, m)
            assert sched.meta["memory_limit"] == p
            assert unit_makespan(sched) == unit_makespan(build_schedule("zb-h1", p, m)) == 3 * m + p - 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: build_schedule("zb-h1", 4, 8, 2), "--virtual 2 is not supported; use 1"),
        (lambda: build_schedule("zb-h2", 4, 0), "needs at least 1 microbatches"),
        (lambda: zb_auto(2, 4, f=[1], i=[1, 1], w=[1, 1]), "give 2 positive f costs"),
        (lambda: zb_auto(2, 4, f=[1, 1], i=[1, 0], w=[1, 1]), "give 2 positive i costs"),
        (lambda: zb_auto(2, 4, f=[1, 1], i=[1, 1], w=[1, 1], memory_limit=0.5), "holds no microbatch"),
        (lambda: zb_auto(2, 4, f=[1, 1], i=[1, 1], w=[1, 1], comm=-1), "comm must be at least 0"),
    ],
)
def test_bad_input_is_a_one_line_schedule_error(call, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_zb_h2_never_slower_than_zb_h1() -> None:
    """With few microbatches ZB-H2's long warm-up does not pay (p = 8, m = 8: 34 against 31); it then
    runs ZB-H1's order."""
    for p in range(2, 9):
        for m in range(1, 3 * p):
            h1, h2 = build_schedule("zb-h1", p, m), build_schedule("zb-h2", p, m)
            assert unit_makespan(h2) <= unit_makespan(h1), (p, m)
    fallback = build_schedule("zb-h2", 8, 8)
    assert unit_makespan(fallback) == 31 and fallback.meta["order"].startswith("zb-h1")


def _edge_heavy(p: int, comm: float) -> ScheduleCosts:
    """The embedding on the first stage and the output layer with its loss on the last make those
    stages slower (GPT-like, Zero Bubble's setting)."""
    f = tuple(1.0 + 0.6 * (s == 0) + 1.2 * (s == p - 1) for s in range(p))
    i = tuple(1.0 + 0.3 * (s == 0) + 1.0 * (s == p - 1) for s in range(p))
    w = tuple(0.6 + 0.4 * (s == p - 1) for s in range(p))
    return ScheduleCosts(f, i, w, comm)


@pytest.mark.parametrize("comm", [0.0, 0.3])
@pytest.mark.parametrize("p", [4, 8])
def test_zb_auto_never_worse_than_the_handcrafted_schedules(p: int, comm: float) -> None:
    """Under the same unequal stage costs and communication, zb-auto at limit p is as fast as zb-h1 and
    at limit 2p as fast as zb-h2 (one iteration, simulated); without an optimizer barrier zb-h2 is as
    fast as zb-h1 and zb-auto at 2p as zb-h2."""
    base = _edge_heavy(p, comm)
    cost = _stage_times(base)
    for m in (p, 2 * p, 3 * p):
        t = {}
        for name, limit in (("zb-h1", None), ("zb-h2", None), ("zb-auto", p), ("zb-auto", 2 * p)):
            sched = build_schedule(name, p, m, costs=replace(base, memory_limit=limit))
            if limit is not None:
                assert max(peak_in_flight(sched)) <= limit
            t[name, limit] = simulate(sched, cost, comm=ConstComm(comm)).iteration_time
        assert t["zb-auto", p] <= t["zb-h1", None] + 1e-9, (m, t)
        assert t["zb-auto", 2 * p] <= t["zb-h2", None] + 1e-9, (m, t)
        # ZB-H2 and zb-auto at 2p are chosen for the period without an optimizer barrier
        period = {}
        for name, limit in (("zb-h1", None), ("zb-h2", None), ("zb-auto", 2 * p)):
            sched = build_schedule(name, p, m, costs=replace(base, memory_limit=limit))
            sim = simulate(sched, cost, comm=ConstComm(comm), iterations=3, step_barrier=False)
            period[name] = sim.iteration_time
        assert period["zb-auto"] <= period["zb-h2"] + 1e-9 and period["zb-h2"] <= period["zb-h1"] + 1e-9


def _stage_times(costs: ScheduleCosts) -> StageTimes:
    return StageTimes(f=costs.f, i=costs.i, w=costs.w)
