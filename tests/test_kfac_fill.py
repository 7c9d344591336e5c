"""The K-FAC bubble-filling pass: every synchronous schedule of the library, dependencies, priorities,
inversion splitting, no lengthening of the iteration by tasks placed in bubbles, and the paper's model
of iterations per refresh with the shared PipeFisher profiles."""

from __future__ import annotations

import pytest

from pipewright.cost.unit import UnitCost
from pipewright.features.kfac.cost import LinearShape, TaskTimes, inversion_piece_weights, split_plan
from pipewright.features.kfac.fill import FIT, FillError, fill_kfac
from pipewright.features.kfac.kinds import (
    KFAC_A,
    KFAC_B,
    KFAC_INV_A,
    KFAC_INV_B,
    KFAC_KINDS_ALL,
    KFAC_PRECOND,
    KFAC_REDUCE,
    Factor,
    Piece,
    factor_of,
    layer_of,
)
from pipewright.features.kfac.utilization import fill_profiled, paper_model
from pipewright.ir import Action, B, F, I
from pipewright.passes.validate import validate
from pipewright.schedules.registry import build_schedule, info, schedule_names

SHAPES = (LinearShape(4, 12), LinearShape(16, 4))


def _times(stages: int, curv: float = 0.25, inv: float = 0.5, prec: float = 0.0) -> TaskTimes:
    """Two layers per chunk with fixed task times (unit-cost schedules: F = 1, B = 2)."""
    return TaskTimes(
        (SHAPES,) * stages,
        (((curv, curv), (curv, curv)),) * stages,
        (((inv, inv), (inv, inv)),) * stages,
        (prec,) * stages,
    )


def _sync_schedules():
    for name in schedule_names():
        entry = info(name)
        if not entry.synchronous:
            continue
        v = entry.default_chunks
        p = 4
        m = max(8, entry.min_microbatches(p, v))
        try:
            yield name, build_schedule(name, p, m, v)
        except Exception:
            yield name, build_schedule(name, p, 2 * m, v)


@pytest.mark.parametrize(
    ("name", "sched"), list(_sync_schedules()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_every_synchronous_schedule_is_filled_and_valid(name, sched):
    times = _times(sched.num_stages)
    res = fill_kfac(sched, UnitCost(), times, max_iterations=40, steady_refreshes=2)
    m = sched.num_microbatches
    expected = sched.num_stages * 2 * (2 * m + 2 + 2)  # per layer: A, B per mb, 2 reductions, 2 inversions
    refresh = [p for p in res.placements if p.action.kind != KFAC_PRECOND]
    assert len(refresh) == expected
    assert len({(p.action, p.rank) for p in refresh}) == expected  # each task once
    for it_sched in res.iterations:
        validate(it_sched)
        plain = [[a for a in row if a.kind not in KFAC_KINDS_ALL] for row in it_sched.actions]
        assert plain == [list(r) for r in res.base.actions]  # the same F/B/comm work, in order
        assert sum(a.kind == KFAC_PRECOND for row in it_sched.actions for a in row) == sched.num_stages
    # tasks that went into bubbles never lengthen an iteration (precondition costs 0 here)
    if res.serial_work == 0:
        assert all(t == pytest.approx(res.iteration_time_before) for t in res.iteration_times_after)
    assert res.utilization_after >= res.utilization_before


def test_dependencies_and_priorities_hold_in_the_placements():
    sched = build_schedule("1f1b", 4, 8)
    res = fill_kfac(sched, UnitCost(), _times(4), max_iterations=40)
    period = res.iteration_time_before
    sims = {}
    from pipewright.features.kfac.cost import KFACCost
    from pipewright.sim.engine import simulate

    base = simulate(res.base, KFACCost(UnitCost(), _times(4)))
    for rank in range(4):
        for a, _s, e in base.spans_of(rank):
            if a.kind in (F, "B", I):
                sims[(F if a.kind == F else I, a.stage, a.microbatch)] = e
    end = {}
    for p in res.placements:
        end[(p.action.kind, p.action.stage, p.action.microbatch, p.action.payload)] = p.end
    for p in res.placements:
        a = p.action
        if a.kind in (KFAC_A, KFAC_B):
            ev = (F if a.kind == KFAC_A else I, a.stage, a.microbatch)
            assert p.start + 1e-9 >= sims[ev]  # after its F / I (in the first iteration at the latest)
        if a.kind == KFAC_REDUCE:
            # one reduction per factor, after that factor's curvature only
            kind = KFAC_A if a.payload.factor == "A" else KFAC_B
            ins = [end[(kind, a.stage, mb, a.payload.layer)] for mb in range(8)]
            assert p.start + 1e-9 >= max(ins)
        if a.kind in (KFAC_INV_A, KFAC_INV_B):
            reduced = (KFAC_REDUCE, a.stage, None, Factor(layer_of(a.payload), factor_of(a.kind)))
            assert p.start + 1e-9 >= end[reduced]
        if p.in_bubble and a.kind != KFAC_REDUCE:
            assert p.end <= (p.iteration + 1) * period + 1e-9
    # priority: a curvature task placed after an inversion started no earlier (it was not ready yet)
    for rank in range(4):
        ps = sorted(
            (p for p in res.placements if p.rank == rank and p.action.kind != KFAC_PRECOND),
            key=lambda p: p.start,
        )
        first_inv = next(i for i, p in enumerate(ps) if p.action.kind in (KFAC_INV_A, KFAC_INV_B))
        curv_after = [p for p in ps[first_inv:] if p.action.kind in (KFAC_A, KFAC_B)]
        inv = ps[first_inv]
        for c in curv_after:
            assert c.start >= inv.start


def test_inversion_longer_than_every_bubble_is_split_or_runs_at_the_end():
    sched = build_schedule("gpipe", 4, 4)  # bubbles of 3 units (F = 1, B = 2) per stage
    long_inv = _times(4, curv=0.1, inv=6.0)
    plain = fill_kfac(sched, UnitCost(), long_inv, split=False, max_iterations=20)
    assert plain.serial_work > 0 and plain.split_inversions == 0
    assert max(plain.iteration_times_after) > plain.iteration_time_before
    split = fill_kfac(sched, UnitCost(), long_inv, split=True, max_iterations=40)
    assert split.split_inversions > 0 and split.serial_work == 0 and split.fitted_fraction == 1.0
    pieces = [p for p in split.placements if isinstance(p.action.payload, Piece)]
    assert pieces
    biggest = 9.0  # GPipe p=4, m=4: the longest bubble is (p−1)(F+B) = 9 units
    assert all(FIT * (p.end - p.start) <= biggest + 1e-9 for p in pieces)
    assert all(t == pytest.approx(split.iteration_time_before) for t in split.iteration_times_after)


def test_piece_weights():
    assert sum(inversion_piece_weights(64, 4, 0)) == pytest.approx(1.0)
    assert sum(inversion_piece_weights(64, 3, 5)) == pytest.approx(7 / 3)
    assert inversion_piece_weights(64, 1, 0) == pytest.approx((1 / 3, 2 / 3))
    assert split_plan(64, 1.0, 0.8) == (1, 0)  # Cholesky, then the inverse: no extra work
    panels, blocks = split_plan(64, 1.0, 0.3)
    assert blocks > 0 and max(inversion_piece_weights(64, panels, blocks)) * 1.05 <= 0.3


def test_precondition_in_the_tail_bubble_vs_after_the_pipeline():
    sched = build_schedule("1f1b", 4, 8)
    times = _times(4, curv=0.0001, inv=0.0001, prec=1.0)
    tail = fill_kfac(sched, UnitCost(), times)
    end = fill_kfac(sched, UnitCost(), times, precondition="end")
    # after the whole pipeline every step grows by T_prec; in the tail bubbles only stage 0's
    # (which ends the pipeline in 1F1B) stays on the critical path
    assert end.iteration_times_after[0] == pytest.approx(end.iteration_time_before + 1.0)
    assert tail.iteration_times_after[0] <= end.iteration_times_after[0]


def test_asynchronous_schedule_is_refused():
    sched = build_schedule("async-1f1b", 4, 8)
    with pytest.raises(FillError, match="synchronous"):
        fill_kfac(sched, UnitCost(), _times(4))


@pytest.mark.parametrize(("name", "stages"), [("gpipe", 8), ("1f1b", 8), ("gpipe", 4)])
def test_iterations_per_refresh_agree_with_the_paper_model(name, stages):
    """BERT-Large on V100, microbatch 32, one block per stage, D = p microbatches (PAPERS.md)."""
    res = fill_profiled(name, "bert-large", "v100", 32, stages, precondition="end")
    model = paper_model("bert-large", "v100", 32, stages)
    assert model == pytest.approx({4: 2.38, 8: 1.61}[stages], abs=0.01)
    assert res.steady_iterations_per_refresh == pytest.approx(model, rel=0.10)
    assert res.fitted_fraction == 1.0


def test_cli_simulate_fill_kfac(tmp_path, capsys):
    import json

    from pipewright.cli import main

    png = tmp_path / "kfac.png"
    args = ["simulate", "--schedule", "1f1b", "--stages", "8", "--microbatches", "8"]
    args += ["--fill", "kfac", "--kfac-profile", "bert-large:v100:32", "--kfac-precondition", "end"]
    assert main([*args, "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steady_iterations_per_refresh"] == pytest.approx(
        paper_model("bert-large", "v100", 32, 8), rel=0.1
    )
    assert out["utilization_after"] > out["utilization_before"]
    assert png.stat().st_size > 10_000
    assert main([*args[:-2], "--kfac-profile", "bert-large"]) != 0
    assert "--kfac-profile wants MODEL:GPU:BS" in capsys.readouterr().err


def test_feature_bundle_registers_kinds_cost_rules_and_the_slot_pass():
    from pipewright.cost.profiled import ProfiledCost
    from pipewright.features import Features
    from pipewright.features.kfac import FEATURE
    from pipewright.features.kfac.cost import KFACCost, pipefisher_task_times
    from pipewright.features.kfac.kinds import KFAC_FILL
    from pipewright.ir import Action
    from pipewright.sim.engine import simulate

    features = Features([FEATURE])
    assert set(KFAC_KINDS_ALL) <= set(features.kinds)
    assert features.kinds[KFAC_REDUCE].collective.group == "dp"
    prof = ProfiledCost.from_pipefisher("bert-large", "v100", 32, layers=4)
    sched = build_schedule("1f1b", 4, 4).with_actions(
        build_schedule("1f1b", 4, 4).actions, kinds=features.kinds
    )
    ruled = features.cost(prof)
    ref = KFACCost(prof, pipefisher_task_times("bert-large", "v100", 32, 4, layers=4))
    for a in (Action(1, KFAC_A, 2, 3), Action(0, KFAC_INV_B, None, 2), Action(2, KFAC_PRECOND)):
        assert ruled.compute_time(a, sched) == pytest.approx(ref.compute_time(a, sched))
    slots = features.passes["kfac-slots"](build_schedule("1f1b", 4, 8))
    assert any(a.kind == KFAC_FILL for row in slots.actions for a in row)
    plain = simulate(build_schedule("1f1b", 4, 8), UnitCost()).iteration_time
    filled = simulate(slots.with_actions(slots.actions, kinds=features.kinds), features.cost(UnitCost()))
    assert filled.iteration_time == pytest.approx(plain + 1)  # empty bubbles; PRECOND of stage 0 costs 1


#: PipeFisher's plan period for BERT-Large/V100, bs 32, D = p, computed by PipeFisher's own
#: auto_schedule.py on pipewright's simulated timelines (tools/pipefisher_reference.py)
PIPEFISHER_AUTO_SCHEDULE = {
    ("gpipe", 4): 4,
    ("1f1b", 4): 4,
    ("gpipe", 8): 2,
    ("1f1b", 8): 3,
    ("gpipe", 16): 2,
    ("1f1b", 16): 2,
}


@pytest.mark.parametrize(("name", "stages"), list(PIPEFISHER_AUTO_SCHEDULE))
def test_pipefisher_plan_period_matches_its_auto_schedule(name: str, stages: int) -> None:
    res = fill_profiled(name, "bert-large", "v100", 32, stages)
    assert res.pipefisher_plan_iterations == PIPEFISHER_AUTO_SCHEDULE[(name, stages)]
    assert res.summary()["pipefisher_plan_iterations"] == res.pipefisher_plan_iterations


def test_a_inversion_waits_for_a_only() -> None:
    """As PipeFisher's inv_kron_A: after A's curvature and A's reduction, not B's curvature. GPipe,
    8 stages: rank 0 inverts every A in the first iteration."""
    res = fill_profiled("gpipe", "bert-large", "v100", 32, 8)
    inv_a = [p for p in res.placements if p.rank == 0 and p.action.kind == KFAC_INV_A]
    assert inv_a and all(p.iteration == 0 for p in inv_a)
    last_b = max(p.end for p in res.placements if p.rank == 0 and p.action.kind == KFAC_B)
    assert min(p.start for p in inv_a) < last_b  # one starts before the last B curvature is done


def test_kfac_tasks_hold_no_recomputation_transient_and_other_actions_keep_the_base_models():
    from pipewright.features.kfac.cost import KFACCost

    class Recomputing(UnitCost):
        def transient_bytes(self, action, schedule):
            return 7.0

    sched = build_schedule("1f1b", 4, 8)
    cost = KFACCost(Recomputing(), _times(4))
    assert cost.transient_bytes(Action(0, B, 0), sched) == 7.0
    assert cost.transient_bytes(Action(0, KFAC_A, 0), sched) == 0.0
    assert KFACCost(UnitCost(), _times(4)).transient_bytes(Action(0, B, 0), sched) == 0.0
