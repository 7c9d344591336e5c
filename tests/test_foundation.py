"""The IR core: string codec, lowering and the validator on literal schedules."""

from __future__ import annotations

import pytest

from pipewright.codec import from_csv, parse_action
from pipewright.errors import PipewrightError, ValidationError
from pipewright.ir import Action, Schedule, loop_placement, peak_in_flight, v_placement
from pipewright.passes import lower, validate
from pipewright.passes.lower import strip_comms
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule


def _sched(rows: list[str], p: int, m: int, placement=None, lowered=False) -> Schedule:
    actions = tuple(tuple(parse_action(x) for x in row.split()) for row in rows)
    placement = placement or loop_placement(p)
    return Schedule("literal", p, len(placement), m, placement, actions, lowered=lowered)


def test_action_string_round_trip() -> None:
    for text in ["2F0", "1SEND_F3", "0I1", "3RECV_B12", "0REDUCE_GRAD", "1STEP"]:
        assert str(parse_action(text)) == text
    assert parse_action("1SEND_F3") == Action(1, "SEND_F", 3)
    with pytest.raises(PipewrightError, match="cannot read action"):
        parse_action("F0")


def test_lowering_inserts_matching_comms_and_local_handoff() -> None:
    sched = build_schedule("1f1b", 2, 2)
    low = lower(sched)
    assert low.actions[0][:3] == (Action(0, "F", 0), Action(0, "SEND_F", 0), Action(0, "F", 1))
    assert low.actions[1][0] == Action(1, "RECV_F", 0)
    validate(low)
    assert strip_comms(low).actions == sched.actions
    # V placement: stages 1 and 2 sit on rank 1 and hand over locally, no send/recv between them.
    vp = v_placement(2)
    rows = ["0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"]
    v_low = lower(_sched(rows, 2, 1, placement=vp))
    comm = [a for a in v_low.actions[1] if "SEND" in a.kind or "RECV" in a.kind]
    assert all(a.stage in (1, 2) for a in comm)
    assert Action(1, "SEND_F", 0) not in v_low.actions[1] or True
    assert not any(a == Action(1, "SEND_F", 0) for a in v_low.actions[1])
    assert not any(a == Action(2, "RECV_F", 0) for a in v_low.actions[1])
    validate(v_low)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["0F0 0B0", "1F0"], "missing 1I0"),
        (["0F0 0B0 0F0", "1F0 1B0"], "duplicated"),
        (["0B0 0F0", "1F0 1B0"], "before its dependency"),
        (["0F0 0B0 0I0", "1F0 1B0"], "a second time"),
        (["0F0 1F0 0B0", "1B0"], "placed on rank 1"),
        (["0F0 0F1 0B1 0B0", "1F0 1F1 1B0 1B1"], None),
        (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], "deadlock"),
    ],
)
def test_validator_names_the_problem(rows: list[str], message: str | None) -> None:
    m = 1 + max(int(x[-1]) for r in rows for x in r.split())
    sched = _sched(rows, 2, m)
    if message is None:
        validate(sched)
        return
    with pytest.raises(ValidationError, match=message) as err:
        validate(sched)
    first = str(err.value).splitlines()[0]
    assert "rank" in first and "position" in first
    assert "[" in str(err.value)  # the grid marks the offending cell


def test_validator_catches_unmatched_comms() -> None:
    low = lower(build_schedule("1f1b", 2, 2))
    rows = [list(r) for r in low.actions]
    rows[1] = [a for a in rows[1] if a != Action(1, "RECV_F", 1)]
    with pytest.raises(ValidationError, match=r"needs 1RECV_F1|unmatched send"):
        validate(low.with_actions(rows))


def test_csv_round_trip_and_memory() -> None:
    sched = build_schedule("1f1b", 4, 8)
    again = from_csv(to_csv(sched))
    assert again.actions == sched.actions and again.placement == sched.placement
    low_again = from_csv(to_csv(sched, with_comms=True))
    assert low_again.lowered and low_again.actions == lower(sched).actions
    assert peak_in_flight(sched) == [4, 3, 2, 1]


def test_timeline_json_round_trip_with_extension_kind() -> None:
    from pipewright.deps import CORE_KINDS
    from pipewright.ir import KindSpec
    from pipewright.timeline import Span, Timeline

    kinds = CORE_KINDS.with_kinds(KindSpec("KFAC_A", lambda a, s: (("F", a.stage, a.microbatch, None),)))
    spans = [Span(0, Action(0, "F", 0), 0.0, 1.0), Span(0, Action(0, "KFAC_A", 0), 1.0, 2.0)]
    tl = Timeline.of(1, spans)
    again = Timeline.from_json(tl.to_json(), kinds)
    assert again.spans == tl.spans
    with pytest.raises(PipewrightError, match="cannot read action"):
        Timeline.from_json(tl.to_json())
