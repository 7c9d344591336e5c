"""``1f1b-overlap``: 1F1B's order with each steady-state F(k + w) and B(k) marked as an F&B pair.

Checked: it validates (compute-only and lowered, the pairs kept through lowering); its actions are
1F1B's, so its unit-cost makespan and its peak memory are 1F1B's; every pair is F(k + w) then B(k) on
one stage (w = min(p − r − 1, m)), none on the last rank; the simulator overlaps the pairs through
the same cost-model path as DualPipeV's (``sim/pair_overlap.py``), chosen by the marks, not the name.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from _unit_makespan import unit_makespan
from pipewright.cost import UnitCost
from pipewright.ir import B, F, peak_in_flight
from pipewright.passes import lower, validate
from pipewright.schedules import build_schedule, info, schedule_names
from pipewright.sim import simulate
from pipewright.sim.pair_overlap import PairOverlapCost, overlapped_pairs

CASES = sorted({(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, p, p + 1, 2 * p + 3)})


@pytest.mark.parametrize(("p", "m"), CASES)
def test_1f1b_order_memory_makespan_and_pairs(p: int, m: int) -> None:
    sched = build_schedule("1f1b-overlap", p, m)
    plain = build_schedule("1f1b", p, m)
    validate(sched)
    low = validate(lower(sched))
    assert [list(r) for r in sched.actions] == [list(r) for r in plain.actions]
    assert peak_in_flight(sched) == peak_in_flight(plain) == info("1f1b-overlap").memory(p, m, 1)
    assert unit_makespan(sched) == unit_makespan(plain)
    pairs = sched.meta["overlapped_pairs"]
    assert len(pairs) == p and low.meta["overlapped_pairs"] == pairs
    for r, positions in enumerate(pairs):
        w = min(p - r - 1, m)
        row = sched.actions[r]
        got = [(row[i].kind, row[i].microbatch, row[i + 1].kind, row[i + 1].microbatch) for i in positions]
        assert got == ([(F, w + k, B, k) for k in range(m - w)] if w else []), (p, m, r)
    # the lowered schedule pairs the same actions (its compute-only order is the schedule's)
    assert overlapped_pairs(low) == overlapped_pairs(sched)


def test_simulator_overlaps_the_marked_pairs() -> None:
    """Unit costs with x = 0.5 of every F and B communication: a pair costs max(c_F + c_B, x_F + x_B)
    = 2 instead of 3 overlapped, so each pair takes 1 off its rank's busy time; blocking, the schedule
    is 1F1B to the time unit. The last rank has no pairs and, with equal stages, sets the pace: the
    makespan stays 1F1B's."""
    p, m = 4, 8
    sched = build_schedule("1f1b-overlap", p, m)
    base = UnitCost(times={"F": 1, "B": 2, "I": 1, "W": 1})

    def exposed(a, s):
        return 0.5 if a.kind in (F, B) else 0.0

    over = simulate(sched, PairOverlapCost(base, exposed))
    blocking = simulate(sched, PairOverlapCost(base, exposed, overlap=False))
    assert blocking.iteration_time == simulate(build_schedule("1f1b", p, m), base).iteration_time
    assert blocking.iteration_time == 3 * (m + p - 1)
    pairs = sched.meta["overlapped_pairs"]
    assert over.busy == tuple(b - len(pairs[r]) for r, b in enumerate(blocking.busy))
    assert over.iteration_time == blocking.iteration_time


def test_moe_simulation_prices_the_overlap_by_the_marks() -> None:
    from pipewright.mesh import Mesh
    from pipewright.models.presets import resolve_model
    from pipewright.plan.setup import model_setup
    from pipewright.topology import cluster

    spec = replace(resolve_model("mixtral-8x7b"), layers=4)
    topo, mesh = cluster(2, 8, "h100-sxm"), Mesh(pp=2, dp=8, ep=8)
    setup = model_setup(spec, topo, mesh, build_schedule("1f1b-overlap", 2, 8), 1, gpu="h100-sxm")
    assert isinstance(setup.cost, PairOverlapCost)
    blocking = replace(setup, cost=PairOverlapCost(setup.cost.base, setup.cost.exposed, overlap=False))
    plain = model_setup(spec, topo, mesh, build_schedule("1f1b", 2, 8), 1, gpu="h100-sxm")
    assert blocking.simulate().makespan == pytest.approx(plain.simulate().makespan, rel=1e-12)
    # rank 0's pairs run overlapped (each saves its blocking time − max(c_F + c_B, x_F + x_B)); the last
    # rank has none and sets the pace of 1F1B's steady state
    base, sched = setup.cost.base, setup.schedule
    saved = 0.0
    for f, b in overlapped_pairs(sched).items():
        t_f, t_b = base.compute_time(f, sched), base.compute_time(b, sched)
        x_f, x_b = setup.cost.exposed(f, sched), setup.cost.exposed(b, sched)
        saved += t_f + t_b - max(t_f - x_f + t_b - x_b, x_f + x_b)
    over, block = setup.simulate(), blocking.simulate()
    assert saved > 0.0
    assert over.busy[0] == pytest.approx(block.busy[0] - saved, rel=1e-12)
    assert over.busy[1] == block.busy[1]
    assert over.makespan <= block.makespan


def test_listed_as_a_repeat_of_1f1b() -> None:
    """Runtime equivalence tests that run every order skip it (its order is 1F1B's, run there)."""
    assert "1f1b-overlap" in schedule_names()
    assert "1f1b-overlap" not in schedule_names(distinct_orders=True) and "1f1b" in schedule_names(
        distinct_orders=True
    )
