"""F&B pairs priced per action (``sim/pair_overlap.py``): a pair's forward lasts the whole overlapped pair
max(c_F + c_B, x_F + x_B), its backward nothing, and every unpaired action its blocking time c + x — on
every path of the simulator (compiled from the compute actions, over the lowered actions, action by
action) — and the planner's simulation of a plan prices the pairs as ``simulate --plan`` does."""

from __future__ import annotations

import json
from functools import partial
from unittest.mock import patch

import pytest

from pipewright.cost.base import FreeComm
from pipewright.cost.unit import StageTimes
from pipewright.ir import B, F, I, W
from pipewright.schedules import build_schedule
from pipewright.sim import engine, simulate
from pipewright.sim.array_coding import varies_per_action
from pipewright.sim.compute_compile import ComputeProgram
from pipewright.sim.pair_overlap import PairOverlapCost, overlapped_pairs

# DualPipeV, p = 2, m = 4: F = I = W = 1, B = I + W = 2; of an F 0.75 is exposed all-to-all, of a B 1.0,
# so an overlapped pair lasts max(0.25 + 1.0, 0.75 + 1.0) = 1.75 (blocking: 3).
BASE = StageTimes(f=(1.0,) * 4, i=(1.0,) * 4, w=(1.0,) * 4)
EXPOSED = {F: 0.75, B: 1.0}
ALONE = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


def _exposed(action, schedule) -> float:
    return EXPOSED.get(action.kind, 0.0)


def _paths(sched, cost):
    """The same simulation by the compile from the compute actions, the compile over the lowered actions
    and the reference path."""
    folded = simulate(sched, cost, comm=FreeComm())
    with patch.object(engine, "compile_fast", partial(engine.compile_fast, fold=False)):
        lowered = simulate(sched, cost, comm=FreeComm())
    with patch.object(engine, "compile_fast", return_value=None):
        per_action = simulate(sched, cost, comm=FreeComm())
    assert isinstance(folded._program, ComputeProgram)
    return folded, lowered, per_action


def test_dualpipev_pairs_by_hand():
    """Worked through by hand (rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; pairs 0F3&3B1,
    3F2&0B0, 3F3&0B1 on rank 0 and 2F2&1B0, 1F3&2B1, 2F3&1B1 on rank 1). Rank 0: 0F0–0F2, 3F0, 3I0,
    3W0, 3F1 end at 7; 0F3&3B1 7–8.75; 3F2&0B0 waits for 2F2 (9.75) and ends 11.5; 3B2 13.5; 3F3&0B1
    waits for 2F3 (13.25) and ends 15.25 only because 3B2 ran to 13.5; 3B3 17.25; 0I2 waits for 1B2
    (17.5); 0W2, 0I3, 0W3 end at 21.5. Rank 1: 1F0 starts at 1, its Fs and 2B0 (after 3I0 at 5) end at
    8; 2F2&1B0 9.75; 1F3&2B1 11.5; 2F3&1B1 13.25; 2B2 waits for 3B2 (13.5) and ends 15.5; 1B2 17.5;
    2I3, 1I3, 2W3, 1W3 end at 21.5. Busy 20.25 on each rank (3 pairs · 1.75 + 15). Each action's
    duration is checked on every path."""
    sched = build_schedule("dualpipev", 2, 4, 2)
    cost = PairOverlapCost(BASE, _exposed)
    assert varies_per_action(cost) and not varies_per_action(BASE)
    assert not varies_per_action(PairOverlapCost(BASE, _exposed, overlap=False))
    pairs = overlapped_pairs(sched)
    assert {(str(f), str(b)) for f, b in pairs.items()} == {
        ("0F3", "3B1"), ("3F2", "0B0"), ("3F3", "0B1"), ("2F2", "1B0"), ("1F3", "2B1"), ("2F3", "1B1"),
    }  # fmt: skip
    second = set(pairs.values())
    for result in _paths(sched, cost):
        assert result.iteration_time == 21.5
        assert [result.timeline.rank_spans(r)[-1].end for r in range(2)] == [21.5, 21.5]
        for r in range(2):
            for span in result.timeline.rank_spans(r):
                a = span.action
                want = 1.75 if a in pairs else 0.0 if a in second else ALONE[a.kind]
                assert span.end - span.start == want, (r, str(a))
        assert result.busy == (20.25, 20.25)
    plain = simulate(sched, BASE, comm=FreeComm())
    blocking = simulate(sched, PairOverlapCost(BASE, _exposed, overlap=False), comm=FreeComm())
    assert blocking._times(0) == plain._times(0)
    # nothing to overlap (x = 0, as with ep = 1): the pairs run as two blocking actions
    for result in _paths(sched, PairOverlapCost(BASE, lambda a, s: 0.0)):
        assert result._times(0) == plain._times(0) and result.busy == plain.busy


def test_paths_agree_with_transfers_and_unequal_stages():
    """With per-stage times and transfers that take time (the compile over the lowered actions against the
    reference path), every action's start and end agree exactly, and each compute action lasts what the
    pair rule gives it."""
    sched = build_schedule("dualpipev", 3, 6, 2)
    base = StageTimes(f=(1.0, 1.5, 1.25, 1.0, 0.75, 1.0), i=(1.0,) * 6, w=(0.5, 0.5, 0.75, 0.5, 0.5, 0.25))
    cost = PairOverlapCost(base, lambda a, s: 0.25 * (a.stage % 3) if a.kind in (F, B) else 0.0)
    from pipewright.cost.base import ConstantComm

    fast = simulate(sched, cost, comm=ConstantComm(0.125))
    with patch.object(engine, "compile_fast", return_value=None):
        slow = simulate(sched, cost, comm=ConstantComm(0.125))
    assert fast.iteration_time == slow.iteration_time and fast.busy == slow.busy
    assert fast._times(0) == slow._times(0)
    for r in range(3):
        for span in fast.timeline.rank_spans(r):
            if sched.kinds[span.action.kind].compute:
                assert span.end - span.start == cost.compute_time(span.action, sched)


def test_planner_simulation_equals_simulate_plan(tmp_path, capsys):
    """A DualPipeV plan of a tiny mixture of experts: the planner's simulated time is what
    ``simulate --plan`` gives for its plan file, and it prices the overlap (not the blocking pairs)."""
    from pipewright.cli import main
    from pipewright.models.presets import resolve_model
    from pipewright.plan.problem import Candidate, Problem
    from pipewright.plan.report import plan_json
    from pipewright.plan.search import SearchResult, _Context, estimate
    from pipewright.plan.simulated import simulate_plan
    from pipewright.topology import cluster

    topo = cluster(1, 8, "h100-sxm")
    prob = Problem(resolve_model("gpt-moe-tiny"), topo, 16)
    c = Candidate(1, 2, 4, 1, 4, "dualpipev", 2, "none", False, "pp", 1, "none", 4)
    ev = simulate_plan(prob, estimate(_Context(prob, tuple(topo.devices)), c))
    planned = ev.simulated
    with patch("pipewright.sim.pair_overlap.with_pair_overlap", lambda cost, sched: cost):
        blocking = simulate_plan(prob, ev).simulated
    assert planned != pytest.approx(blocking, rel=1e-6)
    ev.simulated = planned
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json(prob, SearchResult(ev, [ev], [], 1, 0, 0, 0.0))))
    assert main(["simulate", "--plan", str(path), "--gpu", "h100-sxm", "--nodes", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["iteration_time_s"] == pytest.approx(planned, rel=1e-12)
