"""The simulator against the papers' closed forms (unit costs, free communication), its execution rules
(asynchronous sends, FIFO links, collectives on their own stream, iterations), memory, and its outputs
(metrics, timeline JSON, Chrome trace, PNG, CLI)."""

from __future__ import annotations

import itertools
import json
import struct
from fractions import Fraction

import pytest

from _unit_makespan import ConstComm
from pipewright.cli import main
from pipewright.codec import parse_action
from pipewright.cost import UnitCost
from pipewright.deps import produces, requires
from pipewright.errors import PipewrightError, ValidationError
from pipewright.ir import F, KindSpec, Schedule, loop_placement, peak_in_flight
from pipewright.schedules import build_schedule, info, schedule_names
from pipewright.sim import MemoryLimitError, metrics, simulate
from pipewright.sim.memory import peak_memory
from pipewright.sim.sharing import SharedCompute
from pipewright.timeline import Timeline
from pipewright.viz import draw_timeline, write_trace
from pipewright.viz.trace import trace_events

P_VALUES = range(2, 9)


def _needs(name: str) -> None:
    if name not in schedule_names():
        pytest.skip(f"schedule {name!r} is not registered")


def _literal(rows: list[str], p: int, m: int, stages: int | None = None, kinds=None) -> Schedule:
    placement = loop_placement(p, (stages or p) // p)
    actions = tuple(tuple(parse_action(x, kinds) for x in row.split()) for row in rows)
    extra = {} if kinds is None else {"kinds": kinds}
    return Schedule("literal", p, len(placement), m, placement, actions, **extra)


# --- closed forms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", P_VALUES)
def test_gpipe_and_1f1b_makespan(name: str, p: int) -> None:
    """(m + p − 1)(F + B) with F = 1, B = 2."""
    for m in (1, p - 1, p, 2 * p + 1):
        if m < 1:
            continue
        result = simulate(build_schedule(name, p, m), UnitCost())
        assert result.iteration_time == (m + p - 1) * 3
        assert all(b == m * 3 for b in result.busy)
        assert all(x == (p - 1) * 3 for x in result.bubble)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_makespan(p: int, v: int) -> None:
    """Chunk costs F/v, B/v: (m + (p − 1)/v)(F + B) (Narayanan et al. SC21, §2.2.2)."""
    _needs("interleaved-1f1b")
    for m in (p, 2 * p, 3 * p):
        result = simulate(build_schedule("interleaved-1f1b", p, m, v), UnitCost(per_chunk=True))
        assert result.iteration_time == pytest.approx((m + (p - 1) / v) * 3)


@pytest.mark.parametrize("p", P_VALUES)
def test_zb_h1_bubble(p: int) -> None:
    """ZB-H1's bubble per rank (p − 1)(F + I − W) with F = I = W = 1 (Qi et al. ICLR 2024)."""
    _needs("zb-h1")
    for m in (p, 2 * p, 3 * p + 1):
        result = simulate(build_schedule("zb-h1", p, m), UnitCost())
        assert result.busy == (m * 3,) * p
        assert result.bubble == pytest.approx([(p - 1) * (1 + 1 - 1)] * p)


@pytest.mark.parametrize("name", ["zb-h2", "zbv"])
@pytest.mark.parametrize("p", P_VALUES)
def test_zero_bubble_steady_state(name: str, p: int) -> None:
    """Without the step barrier, ZB-H2's and ZB-V's steady-state period is each rank's compute time
    when F = I = W: the bubbles at the ends of one iteration are filled by the next."""
    _needs(name)
    for m in (2 * p, 3 * p):
        sched = build_schedule(name, p, m)
        result = simulate(sched, UnitCost(), iterations=4, step_barrier=False)
        assert result.iteration_time == pytest.approx(result.busy[0])
        assert result.busy == (result.busy[0],) * p
        assert result.bubble == pytest.approx([0.0] * p)


def test_step_barrier_makes_every_iteration_a_full_makespan() -> None:
    sched = build_schedule("1f1b", 4, 8)
    one = simulate(sched, UnitCost()).iteration_time
    assert simulate(sched, UnitCost(), iterations=3).iteration_time == one
    assert simulate(sched, UnitCost(), iterations=3).iteration_ends == (one, 2 * one, 3 * one)
    # Rank 1 ends its iteration with 5 units of extra work (an extension kind after its backward):
    # with the barrier every iteration waits for it; without, rank 0 starts the next one meanwhile
    # and the period is rank 1's compute time.
    kinds = sched.kinds.with_kinds(KindSpec("K", lambda a, s: (("W", a.stage, a.microbatch, None),)))
    tail = _literal(["0F0 0B0", "1F0 1B0 1K0"], 2, 1, kinds=kinds)
    cost = UnitCost(times={"F": 1, "B": 2, "K": 5})
    assert simulate(tail, cost, iterations=3).iteration_time == 9
    free = simulate(tail, cost, iterations=3, step_barrier=False)
    assert free.iteration_time == 8 == free.busy[1]
    assert free.iteration_ends == (9, 17, 25)


# --- execution rules ---------------------------------------------------------------------------------


def test_comm_overlaps_compute_and_only_delays_the_receive() -> None:
    sched = build_schedule("gpipe", 2, 2)
    result = simulate(sched, UnitCost(), comm=ConstComm(p2p=0.5))
    rank0 = {str(a): (s, e) for a, s, e in result.spans_of(0)}
    rank1 = {str(a): (s, e) for a, s, e in result.spans_of(1)}
    assert rank0["0F1"] == (1, 2)  # the send of 0F0 does not hold rank 0 back
    assert rank0["0SEND_F0"] == (1, 1.5)  # the transfer itself
    assert rank1["1F0"] == (1.5, 2.5)  # the receive waits for the data
    assert rank1["1F1"] == (2.5, 3.5)  # arrived at 2.5 while 1F0 computed: no wait
    comm = [s for s in result.timeline.spans if s.stream == "comm"]
    assert len(comm) == 4 and all(s.duration == 0.5 for s in comm)
    assert result.iteration_time == (2 + 2 - 1) * 3 + 2 * 0.5  # one forward and one backward transfer


def test_links_are_fifo_per_directed_pair() -> None:
    """Two transfers on one link run one after the other; opposite directions do not share."""
    sched = build_schedule("gpipe", 2, 2)
    result = simulate(sched, UnitCost(times={"F": 1, "B": 2}), comm=ConstComm(p2p=5))
    sends = {str(a): (s, e) for a, s, e in result.spans_of(0) if "SEND" in a.kind}
    assert sends["0SEND_F0"] == (1, 6)
    assert sends["0SEND_F1"] == (6, 11)  # issued at 2, waits for the link
    rank1 = {str(a): (s, e) for a, s, e in result.spans_of(1)}
    assert rank1["1F1"] == (11, 12)
    back = {str(a): (s, e) for a, s, e in result.spans_of(1) if "SEND" in a.kind}
    assert back["1SEND_B0"] == (14, 19)  # rank 1 → rank 0 is its own link, idle until now
    assert back["1SEND_B1"] == (19, 24)


def test_reduce_grad_runs_on_a_collective_stream_that_overlaps_compute() -> None:
    rows = [
        "0F0 2F0 2B0 2REDUCE_GRAD 0B0 0REDUCE_GRAD 0STEP 2STEP",
        "1F0 3F0 3B0 3REDUCE_GRAD 1B0 1REDUCE_GRAD 1STEP 3STEP",
    ]
    sched = _literal(rows, 2, 1, stages=4)
    result = simulate(sched, UnitCost(), comm=ConstComm(coll=10))
    r0 = {str(a): (s, e) for a, s, e in result.spans_of(0)}
    # stage 2's reduction starts after 2B0 and overlaps 0B0, which starts at once
    assert r0["2REDUCE_GRAD"][0] == r0["2B0"][1]
    r1 = {str(a): (s, e) for a, s, e in result.spans_of(1)}
    assert r0["0B0"][0] == r1["1B0"][1]  # waits only for rank 1's input gradient
    assert r0["0B0"][1] < r0["2REDUCE_GRAD"][1]  # ... while stage 2's reduction still runs
    assert r0["0REDUCE_GRAD"][0] == r0["2REDUCE_GRAD"][1]  # the collective stream is FIFO
    assert r0["0STEP"][0] == r0["0REDUCE_GRAD"][1]
    assert r0["2STEP"][0] == r0["0STEP"][1]
    assert result.busy[0] == 1 + 1 + 2 + 2 + 1 + 1
    reduce_spans = [s for s in result.timeline.rank_spans(0, "comm")]
    assert [s.duration for s in reduce_spans] == [10, 10]


def test_extension_kinds_are_simulated_by_their_flags() -> None:
    kinds = build_schedule("1f1b", 2, 2).kinds.with_kinds(
        KindSpec("K", lambda a, s: ((F, a.stage, a.microbatch, None),), description="curvature")
    )
    rows = ["0F0 0K0 0F1 0K1 0B0 0B1", "1F0 1K0 1B0 1F1 1K1 1B1"]
    sched = _literal(rows, 2, 2, kinds=kinds)
    result = simulate(sched, UnitCost(times={"F": 1, "B": 2, "K": 0.5}))
    assert result.busy == (2 * 3.5, 2 * 3.5)
    k_spans = [s for s in result.timeline.spans if s.action.kind == "K"]
    assert len(k_spans) == 4 and all(s.duration == 0.5 for s in k_spans)


def test_a_deadlocked_schedule_is_reported_by_the_validator() -> None:
    sched = _literal(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], 2, 2)
    with pytest.raises(ValidationError, match="deadlock"):
        simulate(sched, UnitCost())
    with pytest.raises(ValidationError, match="deadlock"):  # the time-ordered loop of shared cores too
        simulate(sched, UnitCost(), shared=SharedCompute.one_host(2, 1))
    with pytest.raises(PipewrightError, match="iterations"):
        simulate(build_schedule("1f1b", 2, 2), UnitCost(), iterations=0)


# --- memory and metrics ------------------------------------------------------------------------------


def test_memory_peaks_equal_peak_in_flight() -> None:
    """Peak = static + peak chunk-microbatches in flight × activation; peak_in_flight counts a rank's
    microbatches (chunk-microbatches / v)."""
    for name in schedule_names():
        entry = info(name)
        v = entry.default_chunks
        p = 4
        m = max(8, entry.min_microbatches(p, v))
        sched = build_schedule(name, p, m, v)
        result = simulate(sched, UnitCost(activation=3.0))
        expected = [float(x * sched.chunks_per_rank * 3) for x in peak_in_flight(sched)]
        assert list(result.peak_memory) == expected, name
        assert peak_memory(result.timeline, result.schedule, UnitCost(activation=3.0)) == expected


def test_metrics_report_and_memory_limit() -> None:
    result = simulate(build_schedule("1f1b", 4, 8), UnitCost())
    report = metrics(result, num_devices_per_rank=2, peak_flops=1.0, memory_limit=2.5)
    assert report["iteration_time_s"] == 33
    assert report["bubble_fraction"] == pytest.approx(9 / 33)
    assert report["tflops_per_device"] == pytest.approx(96 / 33 / 8 / 1e12)
    assert report["mfu"] == pytest.approx(96 / 33 / 8)
    assert [r["peak_memory_bytes"] for r in report["per_rank"]] == [4, 3, 2, 1]
    assert report["memory"]["fits"] is False and report["memory"]["over_limit"] == [0, 1]
    assert report["per_rank"][0]["bubble_fraction"] == pytest.approx(9 / 33)
    with pytest.raises(MemoryLimitError, match="rank 0 needs"):
        metrics(result, memory_limit=2.5, enforce=True)
    assert metrics(result)["mfu"] is None


# --- outputs -----------------------------------------------------------------------------------------


def test_timeline_json_round_trip_and_busy_agree() -> None:
    result = simulate(build_schedule("1f1b", 3, 5), UnitCost(), comm=ConstComm(p2p=0.25), iterations=2)
    tl = result.timeline
    back = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
    assert back == tl
    assert len([s for s in tl.spans if s.stream == "compute"]) == 2 * 3 * 5 * 2
    assert [tl.busy(r) for r in range(3)] == [2 * b for b in result.busy]


def test_trace_json_is_valid(tmp_path) -> None:
    result = simulate(build_schedule("gpipe", 3, 4), UnitCost(), comm=ConstComm(p2p=3))
    path = write_trace(result.timeline, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(result.timeline.spans)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"
    }
    assert {e["pid"] for e in events} == {0, 1, 2}
    lanes: dict = {}
    for e in events:
        assert e["dur"] >= 0 and (e["pid"], e["tid"]) in names
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # events of one thread never overlap
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))
    assert trace_events(result.timeline)[0]["args"]["name"] == "rank 0"


def test_png_is_written(tmp_path) -> None:
    a = simulate(build_schedule("1f1b", 4, 8), UnitCost())
    b = simulate(build_schedule("gpipe", 4, 8), UnitCost(), comm=ConstComm(p2p=0.3))
    path = draw_timeline([a.timeline, b.timeline], tmp_path / "t.png", titles=["1f1b", "gpipe"])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 300 and len(data) > 10_000


def test_cli_simulate_json_and_files(tmp_path, capsys) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    args = ["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--cost", "unit"]
    assert main([*args, "--json", "--png", str(png), "--trace", str(trace)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["iteration_time_s"] == 33
    assert report["bubble_fraction"] == pytest.approx(9 / 33)
    assert report["mfu"] == pytest.approx(24 / 33)  # unit costs: the busy fraction
    assert report["tflops_per_device"] == pytest.approx(24 / 33)
    assert [set(r) >= {"rank", "busy_s", "bubble_s", "peak_memory_bytes"} for r in report["per_rank"]]
    assert png.read_bytes()[:4] == b"\x89PNG" and json.loads(trace.read_text())["traceEvents"]
    assert main([*args, "--iterations", "3", "--no-step-barrier"]) == 0
    text = capsys.readouterr().out
    assert "iteration time      33" in text and "no step barrier" in text


def test_cli_simulate_csv_and_errors(tmp_path, capsys) -> None:
    csv = tmp_path / "s.csv"
    assert main(["schedule", "export", "1f1b", "-p", "3", "-m", "4", "-o", str(csv)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--schedule", str(csv), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] == (4 + 2) * 3
    assert main(["simulate", "--schedule", "nope", "--stages", "2", "--microbatches", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipewright: error: unknown schedule") and err.count("\n") == 1
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2"]) == 2
    assert "--microbatches" in capsys.readouterr().err


def test_peak_in_flight_unit_is_chunk_microbatches_over_v() -> None:
    sched = build_schedule("gpipe", 2, 3)
    assert peak_in_flight(sched) == [Fraction(3), Fraction(3)]


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_respects_dependencies_and_program_order(name: str) -> None:
    """For every registered schedule, with slow links: each action starts after every event it requires
    (deps.requires), compute actions of a rank run one at a time in program order, and busy time is the
    rank's compute cost."""
    entry = info(name)
    p, v = 3, entry.default_chunks
    m = max(6, entry.min_microbatches(p, v))
    m += (-m) % p  # interleaved schedules want a multiple of p
    result = simulate(build_schedule(name, p, m, v), UnitCost(), comm=ConstComm(p2p=0.7), iterations=2)
    sched = result.schedule
    for it in range(2):
        done: dict = {}
        for rank in range(p):
            for a, _, end in result.spans_of(rank, it):
                for ev in produces(a, sched):
                    done[ev] = end
        for rank in range(p):
            last_end = result.iteration_ends[it - 1] if it else 0.0
            for a, start, end in result.spans_of(rank, it):
                assert all(start >= done[ev] - 1e-9 for ev in requires(a, sched)), (name, a)
                if sched.kinds[a.kind].compute:
                    assert start >= last_end - 1e-9, (name, a)
                    last_end = end
        assert result.busy == tuple(
            sum(UnitCost().compute_time(a, sched) for a in row) for row in sched.actions
        )


def _model_args(*extra: str) -> list[str]:
    return [
        "simulate",
        "--model",
        "gpt-tiny",
        "--gpu",
        "cpu",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--pp",
        "4",
        "--global-batch-size",
        "8",
        "--schedule",
        "1f1b",
        *extra,
    ]


def test_cli_simulate_model_on_a_cluster(capsys) -> None:
    pytest.importorskip("pipewright.cost.transformer")
    assert main(_model_args("--json", "--iterations", "2")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 4 and len(report["per_rank"]) == 4
    assert report["iteration_time_s"] > 0 and 0 < report["mfu"] <= 1 and report["tflops_per_device"] > 0
    assert report["bubble_fraction"] == pytest.approx(
        sum(r["bubble_s"] for r in report["per_rank"]) / (4 * report["iteration_time_s"])
    )
    assert all(r["peak_memory_bytes"] > 0 for r in report["per_rank"]) and report["memory"]["fits"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--tp", "2"), "--tp 2 × --pp 4 × --dp 1 = 8 devices, but the cluster has 4"),
        (("--gpu", "z100"), "unknown GPU kind 'z100'"),
        (("--model", "gpt-huge"), "unknown model 'gpt-huge'"),
        (("--microbatch-size", "3"), "not a multiple"),
    ],
)
def test_cli_simulate_model_errors(change: tuple[str, ...], message: str, capsys) -> None:
    pytest.importorskip("pipewright.cost.transformer")
    args = _model_args()
    for flag, value in zip(change[::2], change[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipewright: error: ") and message in err and err.count("\n") == 1


def test_cli_simulate_memory_limit(capsys) -> None:
    pytest.importorskip("pipewright.cost.transformer")
    big = ["simulate", "--model", "gpt3-175b", "--gpu", "v100", "--nodes", "1", "--pp", "8"]
    big += ["--global-batch-size", "8", "--schedule", "1f1b"]
    assert main([*big, "--json"]) == 1  # a layout that cannot run is not a success
    capsys.readouterr()
    assert main([*big, "--json", "--allow-no-fit"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory"]["fits"] is False and report["memory"]["over_limit"] == list(range(8))
    assert main([*big, "--enforce-memory"]) == 2
    assert "rank 0 needs" in capsys.readouterr().err
