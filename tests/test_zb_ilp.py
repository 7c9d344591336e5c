"""zb-auto's refinement (Qi et al., ICLR 2024, Appendix G): the integer linear program over the order,
started from the heuristic's. Its order validates, keeps the memory limit, and the simulator times it
at the heuristic's iteration time or less — strictly less on two small cases with unequal stages where
the heuristic and the handcrafted orders leave a gap; without scipy one line is logged and the
heuristic's order is kept. Small problems with a time limit (each solve well under a second)."""

from __future__ import annotations

import logging

import pytest

from _unit_makespan import ConstComm
from pipewright.cli import main
from pipewright.cost.unit import StageTimes
from pipewright.errors import ScheduleError
from pipewright.ir import Schedule, peak_in_flight
from pipewright.passes import validate
from pipewright.schedules import ScheduleCosts, build_schedule, zb_ilp
from pipewright.sim import simulate

pytest.importorskip("scipy")


def stage_times(costs: ScheduleCosts) -> StageTimes:
    return StageTimes(f=costs.f, i=costs.i, w=costs.w)


#: (p, m, costs with the memory limit): the heuristic's order is not the best one
GAINING = {
    "p3-m4-limit-p": (3, 4, ScheduleCosts((1.4, 1.8, 1.4), (1.3, 2.3, 1.4), (1.3, 1.7, 1.2), 0.5, 3)),
    "p4-m6-limit-2p": (
        4,
        6,
        ScheduleCosts((1.7, 1.2, 0.6, 1.4), (2.0, 1.2, 0.7, 1.7), (1.3, 0.9, 0.3, 0.6), 0.5, 8),
    ),
}


def _simulated(sched: Schedule, costs: ScheduleCosts, steady: bool) -> float:
    if steady:  # ZB-2p-like orders run with post-validation: the steady period
        run = simulate(
            sched, stage_times(costs=costs), comm=ConstComm(costs.comm), iterations=3, step_barrier=False
        )
        return run.iteration_time
    return simulate(sched, stage_times(costs=costs), comm=ConstComm(costs.comm)).iteration_time


def _with_limit(costs: ScheduleCosts, seconds: float | None) -> ScheduleCosts:
    return ScheduleCosts(costs.f, costs.i, costs.w, costs.comm, costs.memory_limit, seconds)


@pytest.mark.parametrize("case", list(GAINING))
def test_refinement_is_faster_in_the_simulator_and_keeps_the_memory_limit(case: str) -> None:
    p, m, costs = GAINING[case]
    steady = costs.memory_limit >= 2 * p - 1
    heuristic = build_schedule("zb-auto", p, m, costs=costs)
    refined = build_schedule("zb-auto", p, m, costs=_with_limit(costs, 20.0))
    validate(refined)
    assert refined.meta["order"].startswith("ilp refinement of ")
    assert refined.meta["ilp"]["result"] < refined.meta["ilp"]["start"]
    assert max(peak_in_flight(refined)) <= costs.memory_limit
    before, after = _simulated(heuristic, costs, steady), _simulated(refined, costs, steady)
    assert after < before - 0.05, f"{case}: simulated {after} against the heuristic's {before}"


def test_an_optimal_start_is_returned_unchanged_without_a_solve() -> None:
    """p = 4, m = 8, unit costs, limit p: the heuristic's 3m + p − 1 = 27 meets the lower bound (rank
    p − 1 starts at p − 1 and then works 3m without a gap)."""
    costs = ScheduleCosts((1.0,) * 4, (1.0,) * 4, (1.0,) * 4, 0.0, 4, 5.0)
    sched = build_schedule("zb-auto", 4, 8, costs=costs)
    assert sched.meta["ilp"]["solves"] == 0
    assert sched.actions == build_schedule("zb-auto", 4, 8).actions


def test_without_scipy_one_line_is_logged_and_the_heuristic_kept(monkeypatch, caplog) -> None:
    p, m, costs = GAINING["p3-m4-limit-p"]
    monkeypatch.setattr(zb_ilp, "scipy_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        sched = build_schedule("zb-auto", p, m, costs=_with_limit(costs, 5.0))
    assert sched.actions == build_schedule("zb-auto", p, m, costs=costs).actions
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pipewright[ilp]" in lines[0] and "\n" not in lines[0]


def test_a_time_limit_that_is_not_positive_is_refused_in_one_line() -> None:
    with pytest.raises(ScheduleError, match=r"zb-auto: the ILP time limit must be positive \(got 0.0 s\)"):
        build_schedule("zb-auto", 3, 4, costs=_with_limit(GAINING["p3-m4-limit-p"][2], 0.0))


def test_cli_schedule_show_refines(capsys) -> None:
    assert main(["schedule", "show", "zb-auto", "-p", "3", "-m", "4", "--zb-refine"]) == 0
    assert "zb-auto" in capsys.readouterr().out
    assert main(["schedule", "show", "zb-auto", "-p", "3", "-m", "4", "--zb-ilp-time-limit", "0"]) == 2
    assert "--zb-ilp-time-limit must be positive" in capsys.readouterr().err


def test_cli_simulate_refines_zb_auto_only(capsys) -> None:
    assert main(["simulate", "--schedule", "zb-auto", "-p", "4", "-m", "8", "--zb-ilp-time-limit", "2"]) == 0
    assert "ILP refinement: the heuristic's order is optimal" in capsys.readouterr().out
    assert main(["simulate", "--schedule", "1f1b", "-p", "3", "-m", "4", "--zb-refine"]) == 2
    assert "--zb-refine refines zb-auto only (got 1f1b)" in capsys.readouterr().err


def test_cli_plan_refuses_refining_without_zb_auto(capsys) -> None:
    argv = ["plan", "--model", "gpt-tiny", "--gpu", "cpu", "--global-batch-size", "8", "--schedules", "1f1b"]
    assert main([*argv, "--zb-refine", "--no-progress"]) == 2
    assert "--zb-refine refines zb-auto only (got 1f1b)" in capsys.readouterr().err
