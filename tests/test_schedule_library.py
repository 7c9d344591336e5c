"""Every registered schedule: valid before and after lowering, and as much memory as its formula says."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipewright.cli import main
from pipewright.codec import from_csv
from pipewright.errors import ScheduleError
from pipewright.ir import Action, peak_in_flight
from pipewright.passes import lower, validate
from pipewright.schedules import build_schedule, info, schedule_names
from pipewright.schedules.asynchronous import staleness
from pipewright.schedules.classic import check_interleaved, interleaved_1f1b, megatron_order

RANKS = range(2, 9)


def _chunks(name: str) -> list[int]:
    chunks = info(name).chunks
    return [v for v in (1, 2, 3) if chunks is None or v in chunks]


def _check(name: str, p: int, m: int, v: int) -> None:
    sched = build_schedule(name, p, m, v)
    assert (sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches) == (name, p, p * v, m)
    validate(sched)
    validate(lower(sched))
    assert peak_in_flight(sched) == info(name).memory(p, m, v), (name, p, m, v)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("name", schedule_names())
def test_schedule_is_valid_and_memory_matches_formula(name: str, p: int) -> None:
    entry = info(name)
    accepted = 0
    for v in _chunks(name):
        least = entry.min_microbatches(p, v)
        for m in (p, 2 * p, 4 * p):
            if m < least:
                with pytest.raises(ScheduleError, match="microbatches"):
                    build_schedule(name, p, m, v)
                continue
            _check(name, p, m, v)
            accepted += 1
        m = max(least, p) + 1
        try:
            _check(name, p, m, v)
        except ScheduleError as err:  # the schedule does not take this m; it must say so on one line
            assert "\n" not in str(err)
    assert accepted, f"{name} accepted no multiple of p = {p}"


@pytest.mark.parametrize("name", schedule_names())
def test_bad_input_is_a_one_line_schedule_error(name: str) -> None:
    entry = info(name)
    v = entry.default_chunks
    least = entry.min_microbatches(4, v)
    bad_v = 0 if entry.chunks is None else max(entry.chunks) + 1
    for args in [(0, 8, v), (4, least - 1, v), (4, max(least, 8), bad_v)]:
        with pytest.raises(ScheduleError) as err:
            build_schedule(name, *args)
        assert "\n" not in str(err.value) and name in str(err.value)


def test_unknown_schedule_name() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; choose one of: gpipe"):
        build_schedule("nope", 4, 8)


@pytest.mark.parametrize(
    "argv",
    [
        ["nope", "-p", "4", "-m", "8"],
        ["1f1b", "-p", "0", "-m", "8"],
        ["1f1b", "-p", "4", "-m", "0"],
        ["1f1b", "-p", "4", "-m", "8", "-v", "2"],
        ["interleaved-1f1b", "-p", "4", "-m", "10"],
        ["interleaved-1f1b", "-p", "4", "-m", "8", "-v", "0"],
    ],
)
def test_cli_reports_bad_input_on_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "show", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("pipewright: error:")


def test_megatron_schedule_table() -> None:
    # the example in Megatron-Core's comments: PP2, N = 3, M = 5, VP2
    order = megatron_order(5, 2, 3)
    assert [k for k, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    validate(lower(interleaved_1f1b(2, 5, 2, group=3)))
    with pytest.raises(ScheduleError, match="use --microbatches 6 or 9"):
        check_interleaved(2, 7, 2, group=3)


def test_interleaved_order_by_hand() -> None:
    # p = 2, v = 2, m = 4: rank 0 warms up with 2·1 + 1·2 = 4 forwards, rank 1 with 2
    sched = build_schedule("interleaved-1f1b", 2, 4, 2)
    rows = [" ".join(map(str, row)) for row in sched.actions]
    assert rows == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_interleaved_rejects_what_megatron_rejects() -> None:
    with pytest.raises(ScheduleError, match="use --microbatches 8 or 12"):
        build_schedule("interleaved-1f1b", 4, 10, 2)
    with pytest.raises(ScheduleError, match="at least 4 microbatches"):
        build_schedule("interleaved-1f1b", 4, 3, 2)


def test_async_1f1b_steps_after_every_backward() -> None:
    sched = build_schedule("async-1f1b", 4, 8)
    assert not info("async-1f1b").synchronous and sched.meta["flush"] is False
    for r, row in enumerate(sched.actions):
        assert row[: 4 - r - 1] == tuple(Action(r, "F", k) for k in range(4 - r - 1))
        for i, a in enumerate(row):
            if a.kind == "B":
                assert row[i + 1] == Action(r, "STEP", a.microbatch)
        # PipeOptim's s: p − r − 1 updates between a forward and its backward once the pipe is full
        assert [staleness(sched, r, k) for k in range(8)] == [min(k, 4 - r - 1) for k in range(8)]


@pytest.mark.parametrize("with_comms", [False, True])
@pytest.mark.parametrize("name", schedule_names())
def test_cli_export_reads_back_equal(
    name: str, with_comms: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v = info(name).default_chunks
    m = max(8, info(name).min_microbatches(4, v))
    out = tmp_path / "sched.csv"
    argv = ["schedule", "export", name, "-p", "4", "-m", str(m), "-v", str(v), "--format", "torch-csv"]
    argv += ["--with-comms"] * with_comms + ["-o", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    sched = build_schedule(name, 4, m, v)
    expected = lower(sched) if with_comms else sched
    assert from_csv(out.read_text(), name=name) == expected
