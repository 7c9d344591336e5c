"""Single-process pieces of the reliability machinery: the per-attempt store namespace under torchrun
(against a store holding a previous attempt's keys), the recognition of c10d/gloo timeouts, the
``stall-*`` faults, and the report of ranks outside a training step (a save, an evaluation)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipewright.runtime.core.distributed_errors import ActionError
from pipewright.runtime.reliability import nonfinite
from pipewright.runtime.reliability.faults import FaultPlan, parse_faults
from pipewright.runtime.reliability.timeouts import is_timeout
from pipewright.runtime.setup.launch import attempt_store


def test_a_restarted_attempt_gets_a_fresh_namespace_despite_the_previous_attempts_keys(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    # what the previous attempt left: its id, its ranks' hellos and acks, a process-group key
    server.set("pipewright/job/current", "old")
    for r in (1, 2):
        server.set(f"pipewright/job/old/hello/{r}", b"stale")
        server.set(f"pipewright/job/old/ack/{r}", b"stale")
    server.set("pipewright/job/old/default_pg/key", b"previous attempt")
    stores: dict[int, dist.Store] = {}

    def join(rank: int, delay: float) -> None:
        time.sleep(delay)
        stores[rank] = attempt_store(rank, 3, timedelta(seconds=20), window_s=0.2)

    # the other ranks start first and read the old id; rank 0 comes late
    threads = [threading.Thread(target=join, args=(r, d)) for r, d in ((1, 0.0), (2, 0.1), (0, 0.8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(stores) == [0, 1, 2]
    assert not stores[1].check(["default_pg/key"])  # nothing of the old attempt is visible
    stores[0].set("default_pg/key", b"this attempt")
    assert stores[1].get("default_pg/key") == stores[2].get("default_pg/key") == b"this attempt"
    assert server.get("pipewright/job/current") != b"old"


def test_timeouts_are_recognised_through_the_wrappers_that_carry_them():
    gloo = RuntimeError("[tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv operation to complete")
    assert is_timeout(gloo)
    assert is_timeout(RuntimeError("Application timeout caused pair closure"))
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ActionError("rank 0 (pp 0), position 3, action 0TOY_AR0: ...") from e
    except ActionError as wrapped:
        assert is_timeout(wrapped)
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_timeout(ValueError("timed out"))  # not a c10d error


def test_stall_reduce_fires_once_before_the_gradient_all_reduce_of_its_step():
    (fault,) = parse_faults("stall-reduce:rank=3:step=1:ms=5000")
    assert (fault.kind, fault.rank, fault.step, fault.ms) == ("stall-reduce", 3, 1, 5000)
    assert not FaultPlan([fault], rank=2, attempt=0)  # another rank's fault
    wake = threading.Event()
    plan = FaultPlan([fault], rank=3, attempt=0, wake=wake)
    plan.at_action(1, 15, 17, "B")  # other kinds, other steps: nothing
    plan.at_action(0, 15, 17, "REDUCE_GRAD")
    assert plan.faults == [fault]
    wake.set()  # a SIGTERM ends the stall at once
    t0 = time.monotonic()
    plan.at_action(1, 15, 17, "REDUCE_GRAD")
    assert time.monotonic() - t0 < 2.0
    assert not plan.faults  # fired, and only once


def test_save_and_evaluation_stalls_fire_only_where_they_are_due():
    wake = threading.Event()
    plan = FaultPlan(
        parse_faults("stall-save:rank=0:step=4:ms=60000;stall-eval:step=2:pos=3:ms=60000"), 0, 0, wake
    )
    plan.in_save(4, "start")  # not yet: the stall is at the write
    plan.in_save(2, "write")  # another checkpoint
    plan.at_action(2, 3, 8, "F")  # a training step's position 3, not the evaluation's
    plan.at_action(2, 2, 8, "F", "evaluate")  # another position
    assert len(plan.faults) == 2
    wake.set()
    plan.in_save(4, "write")
    plan.at_action(2, 3, 8, "F", "evaluate")
    assert not plan.faults  # both fired, once


def test_a_report_outside_the_schedule_says_what_each_rank_does_and_draws_no_grid():
    from pipewright.ir import Action
    from pipewright.runtime.reliability.hang import Position, render_positions

    rows = ((Action(0, "F", 0), Action(0, "SEND_F", 0)), (Action(1, "RECV_F", 0), Action(1, "F", 0)))
    labels = {0: "rank 0 (pp 0)", 1: "rank 1 (pp 1)"}
    saving = {
        0: Position(4, "checkpoint", action="waiting for the other ranks' shards"),
        1: Position(4, "checkpoint", action="writing its shards"),
    }
    assert render_positions(rows, saving, {0: 0, 1: 1}, labels) == (
        "rank 0 (pp 0): saving checkpoint step_4, waiting for the other ranks' shards\n"
        "rank 1 (pp 1): saving checkpoint step_4, writing its shards"
    )
    evaluating = {0: Position(2, "evaluate", 1, "0SEND_F0"), 1: Position(2, "evaluate", 0, "1RECV_F0")}
    lines = render_positions(rows, evaluating, {0: 0, 1: 1}, labels).splitlines()
    assert lines[:2] == [
        "rank 0 (pp 0): evaluating after step 2, position 1 0SEND_F0",
        "rank 1 (pp 1): evaluating after step 2, position 0 1RECV_F0",
    ]
    assert lines[3].split()[-1] == "[0SEND_F0]" and lines[4].split()[-2] == "[1RECV_F0]"
    # a position whose action is not the grid's there (another schedule) is not marked
    other = {0: Position(2, "evaluate", 1, "0F1"), 1: None}
    assert "[" not in render_positions(rows, other, {0: 0, 1: 1}, labels)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_timeouts_must_be_positive(value):
    from pipewright.errors import ConfigError
    from pipewright.runtime.setup.config import TrainConfig

    for name in ("recv_timeout_s", "collective_timeout_s"):
        with pytest.raises(ConfigError, match="positive number of seconds"):
            TrainConfig(**{name: float(value)}).check()


def test_skipping_every_step_or_too_many_in_a_row_stops_the_run_in_one_line():
    """--on-nonfinite skip stops a run that never applies an update: all of a short run's steps, or
    MAX_SKIPPED_IN_A_ROW in a row of a long one; fewer in a row go on."""
    limit = nonfinite.MAX_SKIPPED_IN_A_ROW
    assert nonfinite.skip_streak_error(1, steps=20) is None
    assert nonfinite.skip_streak_error(limit - 1, steps=100) is None
    assert nonfinite.skip_streak_error(limit - 1, steps=None) is None
    short = nonfinite.skip_streak_error(6, steps=6)
    assert short == (
        "--on-nonfinite skip skipped all 6 steps of the run (non-finite values every time, no update "
        f"applied); stopped (the limit is {limit} in a row)"
    )
    long = nonfinite.skip_streak_error(limit, steps=100)
    assert long is not None and f"skipped {limit} steps in a row" in long and "\n" not in long
    assert nonfinite.skip_streak_error(limit, steps=None) == long
