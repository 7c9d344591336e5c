"""V-shape schedules: ZB-V, V-Half, V-Min and DualPipeV on the V placement."""

from __future__ import annotations

import pytest

from _unit_makespan import steady_period, unit_makespan
from pipewright.errors import ScheduleError
from pipewright.ir import RECV_B, RECV_F, SEND_B, SEND_F, B, F, peak_in_flight, v_placement
from pipewright.passes import lower, validate
from pipewright.schedules import build_schedule, info
from pipewright.schedules.vshape import block_memory

NAMES = ("zbv", "zbv-torch", "v-half", "v-min", "dualpipev")


def _cases(name: str) -> list[tuple[int, int]]:
    cases = []
    for p in range(2, 9):
        least = info(name).min_microbatches(p, 2)
        cases += [(p, m) for m in sorted({p, 2 * p, 4 * p, 2 * p + 1, 3 * p - 1}) if m >= least]
    return cases


def _one_f_one_b_bubble(p: int) -> int:
    """1F1B on the same layers (a rank's two chunks as one stage: F = 2, B = 4 chunk units)."""
    m = 2 * p
    costs = {"F": 2, "B": 4, "I": 2, "W": 2}
    return unit_makespan(build_schedule("1f1b", p, m), costs) - 6 * m


@pytest.mark.parametrize("name", NAMES)
def test_valid_lowered_local_turn_and_memory_formula(name: str) -> None:
    for p, m in _cases(name):
        sched = build_schedule(name, p, m)
        assert sched.placement == v_placement(p) and sched.chunks_per_rank == 2
        validate(sched)
        low = lower(sched)
        validate(low)
        comms = {(a.stage, a.kind) for row in low.actions for a in row}
        # the turn of the V: stages p − 1 and p both sit on rank p − 1 and hand over locally
        for turn in [(p - 1, SEND_F), (p, RECV_F), (p, SEND_B), (p - 1, RECV_B)]:
            assert turn not in comms, (name, p, m, turn)
        assert (0, SEND_F) in comms and (2 * p - 1, SEND_B) in comms
        assert peak_in_flight(sched) == info(name).memory(p, m, 2), (name, p, m)


def test_zbv_zero_bubble_at_1f1b_memory() -> None:
    for p in range(2, 9):
        for m in (2 * p - 1, 2 * p, 4 * p):
            sched = build_schedule("zbv", p, m)
            assert peak_in_flight(sched) == [p] * p  # 1F1B's peak (rank 0 of 1F1B holds p)
            assert unit_makespan(sched) == 6 * m + p - 1  # one iteration alone: fill and drain only
            assert steady_period(sched) == 6 * m  # without an optimizer barrier: zero bubble


def test_v_half_and_v_min_trade_memory_for_bubble() -> None:
    for p in range(3, 9):
        m = 3 * p
        full = _one_f_one_b_bubble(p)
        assert full == 6 * (p - 1)
        half, third = build_schedule("v-half", p, m), build_schedule("v-min", p, m)
        assert max(peak_in_flight(half)) == p // 2 + 1
        # the squeeze lets every rank rise to the block's largest peak, as the reference code does
        assert max(peak_in_flight(third)) == (p + 1) // 3 + 1
        assert max(peak_in_flight(third)) <= max(block_memory("v-min", p, m))
        bubble_half = unit_makespan(half) - 6 * m
        bubble_third = unit_makespan(third) - 6 * m
        assert bubble_half <= full * 2 / 3, (p, bubble_half, full)
        assert bubble_third < full, (p, bubble_third, full)
        if p >= 6:
            assert bubble_third <= full * 3 / 4


def test_dualpipev_pairs_and_makespan() -> None:
    for p in range(2, 9):
        for m in (2 * p, 4 * p):
            sched = build_schedule("dualpipev", p, m)
            pairs = sched.meta["overlapped_pairs"]
            assert len(pairs) == p and any(pairs)
            for rank, positions in enumerate(pairs):
                row = sched.actions[rank]
                for pos in positions:
                    fwd, bwd = row[pos], row[pos + 1]
                    assert fwd.kind == F and bwd.kind == B and fwd.stage != bwd.stage
            kinds = {a.kind for row in sched.actions for a in row}
            assert kinds == {"F", "B", "I", "W"}
            assert unit_makespan(sched) == 6 * m + p - 1


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        ("zbv", 4, 8, 1, "--virtual 1 is not supported; use 2"),
        ("v-half", 4, 8, 3, "--virtual 3 is not supported; use 2"),
        ("v-min", 4, 0, 2, "needs at least 1 microbatches"),
        ("dualpipev", 4, 7, 2, "needs at least 8 microbatches"),
    ],
)
def test_bad_input_is_a_one_line_schedule_error(name: str, p: int, m: int, v: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as err:
        build_schedule(name, p, m, v)
    assert "\n" not in str(err.value)
