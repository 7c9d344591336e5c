"""Processor sharing (``pipewright.sim.sharing``): with a unit per rank it is the default simulator
exactly; one shared unit is work-conserving (makespan = total compute); a measured slowdown curve gives
the hand-computed times; the optimizer step's makespan; the run's sharing from its profile;
``pipewright simulate --profile --cores``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _unit_makespan import ConstComm
from pipewright.cli import main
from pipewright.cost import UnitCost
from pipewright.cost.profiled import LAYER_TYPES, ProfiledComm, ProfiledCost, ProfileRow, write_profile_csv
from pipewright.errors import PipewrightError
from pipewright.runtime.profiling.compare import host_sharing, profile_workers
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import build_schedule, schedule_names
from pipewright.sim import simulate
from pipewright.sim.sharing import SharedCompute, makespan_together

COSTS = UnitCost(times={"F": 1.0, "B": 2.0, "I": 1.25, "W": 0.75})


def _schedules(p: int, m: int) -> list:
    out = []
    for name in schedule_names():
        try:
            out.append(build_schedule(name, p, m))
        except PipewrightError:
            continue  # this (p, m) is not allowed for this schedule
    return out


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 5),
    m=st.integers(1, 10),
    f=st.floats(0.1, 3),
    b=st.floats(0.1, 5),
    comm=st.sampled_from([0.0, 0.3]),
    iterations=st.integers(1, 3),
    barrier=st.booleans(),
)
def test_a_unit_per_rank_is_the_default_simulator(p, m, f, b, comm, iterations, barrier) -> None:
    cost = UnitCost(times={"F": f, "B": b, "I": b / 2, "W": b / 2})
    for sched in _schedules(p, m):
        kwargs = {"comm": ConstComm(p2p=comm), "iterations": iterations, "step_barrier": barrier}
        plain = simulate(sched, cost, **kwargs)
        shared = simulate(
            sched, cost, shared=SharedCompute.one_host(sched.num_ranks, sched.num_ranks), **kwargs
        )
        assert shared.iteration_ends == pytest.approx(plain.iteration_ends, rel=1e-12), sched.name
        assert shared.busy == pytest.approx(plain.busy, rel=1e-12), sched.name
        for rank in range(sched.num_ranks):
            got = [(str(a), s, e) for a, s, e in shared.spans_of(rank, iterations - 1)]
            want = [(str(a), s, e) for a, s, e in plain.spans_of(rank, iterations - 1)]
            assert [g[0] for g in got] == [w[0] for w in want]
            flat = [t for g in got for t in g[1:]]
            assert flat == pytest.approx([t for w in want for t in w[1:]], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 7)])
def test_one_shared_unit_is_work_conserving(p: int, m: int) -> None:
    """On one unit some rank can always run, so the makespan is exactly the total compute."""
    for sched in _schedules(p, m):
        total = sum(simulate(sched, COSTS).busy)
        result = simulate(sched, COSTS, shared=SharedCompute.one_host(sched.num_ranks, 1))
        assert result.makespan == pytest.approx(total, rel=1e-9), sched.name
        # two units: never slower than one, never faster than a unit per rank
        two = simulate(sched, COSTS, shared=SharedCompute.one_host(sched.num_ranks, 2)).makespan
        assert simulate(sched, COSTS).makespan - 1e-9 <= two <= result.makespan + 1e-9, sched.name


def test_a_measured_slowdown_curve_stretches_overlapping_actions() -> None:
    """GPipe p = 2, m = 2, F = 1, B = 2 on a host whose two busy processes each run 1.5x slower."""
    sched = build_schedule("gpipe", 2, 2)
    shared = SharedCompute.one_host(2, 2, slowdown=(1.0, 1.5))
    result = simulate(sched, UnitCost(times={"F": 1, "B": 2}), shared=shared)
    spans = {str(a): (s, e) for r in range(2) for a, s, e in result.spans_of(r) if a.kind in "FB"}
    assert spans["0F0"] == (0, 1)  # alone
    assert spans["0F1"] == spans["1F0"] == (1, 2.5)  # together: 1 unit of work at rate 2/3
    assert spans["1F1"] == (2.5, 3.5) and spans["1B0"] == (3.5, 5.5)  # alone
    assert spans["0B0"] == spans["1B1"] == (5.5, 8.5)  # together
    assert spans["0B1"] == (8.5, 10.5)
    assert result.iteration_time == 10.5
    assert result.busy == (7.5, 7.5)  # wall time spent computing, stretched


def test_rates_and_validation() -> None:
    ideal = SharedCompute.one_host(4, 2)
    assert [ideal.rate(n, 2) for n in (1, 2, 3, 4)] == [1, 1, pytest.approx(2 / 3), 0.5]
    curve = SharedCompute.one_host(4, 2, slowdown=(0.9, 1.0, 1.6), processes_per_rank=1)
    assert curve.rate(1, 2) == pytest.approx(1 / 0.9) and curve.rate(4, 2) == pytest.approx(1 / (1.6 * 4 / 3))
    tp_dp = SharedCompute.one_host(2, 4, processes_per_rank=4)  # 2 pipeline ranks x 4 processes on 4 cores
    assert tp_dp.rate(1, 4) == 1 and tp_dp.rate(2, 4) == 0.5
    with pytest.raises(PipewrightError, match="more than one host"):
        SharedCompute(((0, 1), (1, 2)), (1, 1))
    with pytest.raises(PipewrightError, match="positive"):
        SharedCompute.one_host(2, 0)
    with pytest.raises(PipewrightError, match="slowdown"):
        SharedCompute.one_host(2, 2, slowdown=(1.0, -1.0))
    # a rank outside every host keeps a unit of its own
    lone = SharedCompute(((0, 1),), (1.0,), slowdown=(2.0, 2.0))
    result = simulate(build_schedule("gpipe", 3, 1), UnitCost(), shared=lone)
    assert {str(a): (s, e) for a, s, e in result.spans_of(2) if a.kind == "F"}["2F0"] == (4, 5)


def test_makespan_together() -> None:
    assert makespan_together([1, 2], SharedCompute.one_host(2, 1)) == 3  # work-conserving
    assert makespan_together([1, 2], SharedCompute.one_host(2, 2)) == 2  # a core each
    assert makespan_together([1, 1], SharedCompute.one_host(2, 2, slowdown=(1.0, 1.5))) == 1.5
    assert makespan_together([1, 3], SharedCompute.one_host(2, 1)) == 4


def test_the_runs_sharing_comes_from_its_profile() -> None:
    c = TrainConfig(pp=4, tp=1, dp=1)
    assert host_sharing(TrainConfig(pp=2), {}, cores=2) is None  # a core per worker, no curve
    ideal = host_sharing(c, {}, cores=2)
    assert ideal is not None and ideal.slowdown is None and ideal.units == (2.0,)
    # the curve is taken relative to the profile's own busy workers (2)
    measured = host_sharing(c, {"contention": "1.0,1.1,1.65,2.2", "workers": "2"}, cores=2)
    assert measured.slowdown == pytest.approx((1 / 1.1, 1.0, 1.5, 2.0))
    with_tp = host_sharing(TrainConfig(pp=2, tp=2, dp=2), {}, cores=2)
    assert with_tp.processes_per_rank == 4 and with_tp.units == (2.0,)
    assert profile_workers(c, cores=2) == 2
    assert profile_workers(TrainConfig(pp=2), cores=8) == 2
    assert profile_workers(TrainConfig(pp=2, tp=2, dp=2), cores=6) == 6
    assert profile_workers(TrainConfig(pp=2, tp=4), cores=2) == 4  # at least one tp group


def _profile(path, contention: str | None = None) -> ProfiledCost:
    """A synthetic profile: per layer F = 1, B = 2, I = W = 1 ms; embedding/output 0.5 ms each kind."""
    base = {"embedding": 5e-4, "layer": 1e-3, "output": 5e-4}
    rows = [ProfileRow(lt, 2, k, base[lt] * (2 if k == "B" else 1)) for lt in LAYER_TYPES for k in "FBIW"]
    rows += [ProfileRow(lt, 2, "PARAMS", 0.0, 1e6) for lt in LAYER_TYPES]
    rows += [ProfileRow(lt, 2, "STEP", 1e-4) for lt in LAYER_TYPES]
    rows.append(ProfileRow("layer", 2, "MESSAGE", 2e-4, 65536.0))
    meta = {"layers": 8, "tp": 1, "workers": 2} | ({"contention": contention} if contention else {})
    path.write_text(write_profile_csv(rows, meta))
    return ProfiledCost(tuple(rows), 2, 8, meta={k: str(v) for k, v in meta.items()})


def _simulate_json(capsys, argv: list[str]) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_simulate_with_a_profile_and_shared_cores(tmp_path, capsys) -> None:
    path = tmp_path / "p.csv"
    cost = _profile(path, contention="1.0,1.1,1.65,2.2")
    sched = build_schedule("1f1b", 4, 8)
    comm = ProfiledComm.from_cost(cost)
    args = ["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--profile", str(path)]
    plain = _simulate_json(capsys, args)
    assert plain["iteration_time_s"] == pytest.approx(simulate(sched, cost, comm=comm).iteration_time)
    shared = _simulate_json(capsys, [*args, "--cores", "2"])
    curve = SharedCompute.from_profile(4, 2, cost.meta)
    assert curve.slowdown == pytest.approx((1 / 1.1, 1.0, 1.5, 2.0))  # relative to its 2 workers
    want = simulate(sched, cost, comm=comm, shared=curve).iteration_time
    assert shared["iteration_time_s"] == pytest.approx(want)
    assert shared["iteration_time_s"] > plain["iteration_time_s"]  # four ranks on two cores
    # unit costs on one core: the total work, 4 ranks x 8 microbatches x (F 1 + B 2)
    unit = ["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--cores", "1"]
    one = _simulate_json(capsys, unit)
    assert one["iteration_time_s"] == pytest.approx(96)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", "missing.csv"], "does not exist"),
        (["--profile", "P", "--model", "gpt"], "give one of --cost unit, --model, --profile"),
        (["--cores", "0"], "--cores must be positive"),
    ],
)
def test_cli_simulate_profile_errors(extra, message, tmp_path, capsys) -> None:
    path = tmp_path / "p.csv"
    _profile(path)
    extra = [str(path) if x == "P" else x for x in extra]
    argv = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
