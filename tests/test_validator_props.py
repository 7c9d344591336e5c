"""Property tests: the validator against an independent brute-force oracle; codec round trips.

The oracle below is written from the rules table in :mod:`pipewright.deps`'s docstring, not from
``passes/validate.py``: it counts what every (stage, microbatch) computes and sends, then executes the
ranks one ready action at a time with blocking receives (sends never block).
"""

from __future__ import annotations

import string
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipewright.codec import from_csv, parse_action
from pipewright.deps import CORE_KINDS
from pipewright.errors import ValidationError
from pipewright.ir import Action, Schedule
from pipewright.passes import lower, validate
from pipewright.passes.lower import strip_comms
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule, info, schedule_names

COMPUTE = {"F", "B", "I", "W"}
COMMS = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
PER_STAGE = {"REDUCE_GRAD"}


def _crossing(s: Schedule, a: int, b: int) -> bool:
    return 0 <= a < s.num_stages and 0 <= b < s.num_stages and s.placement[a] != s.placement[b]


def _expected_comms(s: Schedule) -> Counter:
    """The point-to-point actions a lowered schedule must hold exactly once each."""
    need: Counter = Counter()
    if not s.lowered:
        return need
    for st_ in range(s.num_stages - 1):
        if _crossing(s, st_, st_ + 1):
            for k in range(s.num_microbatches):
                need.update(
                    [
                        Action(st_, "SEND_F", k),
                        Action(st_ + 1, "RECV_F", k),
                        Action(st_ + 1, "SEND_B", k),
                        Action(st_, "RECV_B", k),
                    ]
                )
    return need


def _well_formed(s: Schedule) -> bool:
    """Each action in range and on its rank; exactly the computations and messages the schedule needs."""
    actions = [(rank, a) for rank, row in enumerate(s.actions) for a in row]
    for rank, a in actions:
        if a.kind not in COMPUTE | COMMS | PER_STAGE | {"STEP"} or not 0 <= a.stage < s.num_stages:
            return False
        if s.placement[a.stage] != rank:
            return False
        needs_mb = a.kind in COMPUTE | COMMS
        if a.microbatch is None:
            if needs_mb:
                return False
        elif a.kind in PER_STAGE or not 0 <= a.microbatch < s.num_microbatches:
            return False
    count = Counter(a for _, a in actions)
    if any(n > 1 for n in count.values()):
        return False
    for st_ in range(s.num_stages):
        for k in range(s.num_microbatches):
            f, b, i, w = (count[Action(st_, kind, k)] for kind in "FBIW")
            if not (f == 1 and (b, i, w) in ((1, 0, 0), (0, 1, 1))):
                return False
    comms = Counter(a for _, a in actions if a.kind in COMMS)
    return comms == _expected_comms(s)


def _ready(a: Action, done: set[Action], s: Schedule) -> bool:
    """Whether ``a``'s inputs exist, given the set of actions that have finished."""
    st_, k, last = a.stage, a.microbatch, s.num_stages - 1

    def grad_of(stage: int) -> bool:  # input gradient of (stage, k) computed, by I or by a full B
        return Action(stage, "I", k) in done or Action(stage, "B", k) in done

    def weights_of(stage: int, mb: int) -> bool:
        return Action(stage, "W", mb) in done or Action(stage, "B", mb) in done

    if a.kind == "F":
        if st_ == 0:
            return True
        if s.lowered and _crossing(s, st_ - 1, st_):
            return Action(st_, "RECV_F", k) in done
        return Action(st_ - 1, "F", k) in done
    if a.kind in ("B", "I"):
        if Action(st_, "F", k) not in done:
            return False
        if st_ == last:
            return True
        if s.lowered and _crossing(s, st_, st_ + 1):
            return Action(st_, "RECV_B", k) in done
        return grad_of(st_ + 1)
    if a.kind == "W":
        return Action(st_, "I", k) in done
    if a.kind == "SEND_F":
        return Action(st_, "F", k) in done
    if a.kind == "SEND_B":
        return grad_of(st_)
    if a.kind == "RECV_F":
        return Action(st_ - 1, "SEND_F", k) in done
    if a.kind == "RECV_B":
        return Action(st_ + 1, "SEND_B", k) in done
    if a.kind == "STEP" and k is not None:
        return weights_of(st_, k)
    everything = all(weights_of(st_, mb) for mb in range(s.num_microbatches))
    if a.kind == "STEP" and any(x.kind == "REDUCE_GRAD" for row in s.actions for x in row):
        return everything and Action(st_, "REDUCE_GRAD", None) in done
    return everything  # REDUCE_GRAD, or STEP of a schedule without reductions


def oracle_valid(s: Schedule) -> bool:
    """Brute force: well formed, and running the ranks with blocking receives finishes."""
    if not _well_formed(s):
        return False
    heads = [0] * s.num_ranks
    done: set[Action] = set()
    moved = True
    while moved:
        moved = False
        for rank, row in enumerate(s.actions):
            if heads[rank] < len(row) and _ready(row[heads[rank]], done, s):
                done.add(row[heads[rank]])
                heads[rank] += 1
                moved = True
                break  # one action at a time, then look at every rank again
    return all(h == len(row) for h, row in zip(heads, s.actions, strict=True))


# ---------------------------------------------------------------------------------------------------
# mutations


@st.composite
def library_schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(schedule_names()))
    entry = info(name)
    v = draw(st.sampled_from([c for c in (1, 2) if entry.chunks is None or c in entry.chunks] or [1]))
    p = draw(st.integers(2, 4))
    m = max(draw(st.sampled_from([p, 2 * p])), entry.min_microbatches(p, v))
    sched = build_schedule(name, p, m, v)
    return lower(sched) if draw(st.booleans()) else sched


def _replace_rows(s: Schedule, rows: list[list[Action]]) -> Schedule:
    return s.with_actions(rows)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[Schedule, str]:
    s = draw(library_schedules())
    rows = [list(r) for r in s.actions]
    rank = draw(st.integers(0, s.num_ranks - 1))
    row = rows[rank]
    i = draw(st.integers(0, len(row) - 1))
    how = draw(st.sampled_from(["drop", "duplicate", "swap", "move", "microbatch", "stray"]))
    other_mb = st.one_of(st.none(), st.integers(-1, s.num_microbatches))
    if how == "drop":
        del row[i]
    elif how == "duplicate":
        row.insert(draw(st.integers(0, len(row))), row[i])
    elif how == "swap":
        j = draw(st.integers(0, len(row) - 1))
        row[i], row[j] = row[j], row[i]
    elif how == "move":
        other = draw(st.integers(0, s.num_ranks - 1).filter(lambda r: r != rank))
        rows[other].insert(draw(st.integers(0, len(rows[other]))), row.pop(i))
    elif how == "microbatch":
        row[i] = row[i]._replace(microbatch=draw(other_mb))
    else:  # a copy with another (or no) microbatch index inserted anywhere on the rank
        row.insert(draw(st.integers(0, len(row))), row[i]._replace(microbatch=draw(other_mb)))
    return _replace_rows(s, rows), how


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_validator_agrees_with_oracle_on_mutations(case: tuple[Schedule, str]) -> None:
    sched, how = case
    expected = oracle_valid(sched)
    try:
        validate(sched)
        accepted = True
    except ValidationError as err:
        accepted = False
        assert "rank" in str(err).splitlines()[0]
    assert accepted == expected, f"{how}: validator {'accepts' if accepted else 'rejects'}\n{sched.grid()}"


@pytest.mark.parametrize("name", schedule_names())
def test_oracle_accepts_the_library(name: str) -> None:
    v = info(name).default_chunks
    m = max(8, info(name).min_microbatches(4, v))
    sched = build_schedule(name, 4, m, v)
    assert oracle_valid(sched) and oracle_valid(lower(sched))


def test_swaps_that_keep_validity_are_accepted() -> None:
    # swapping two independent forwards on rank 0 keeps 1F1B valid; swapping F and its B does not
    sched = build_schedule("1f1b", 2, 4)
    rows = [list(r) for r in sched.actions]
    rows[0][0], rows[0][1] = rows[0][1], rows[0][0]
    validate(sched.with_actions(rows))
    assert oracle_valid(sched.with_actions(rows))
    rows = [list(r) for r in sched.actions]
    rows[1][0], rows[1][1] = rows[1][1], rows[1][0]
    with pytest.raises(ValidationError, match="before its dependency"):
        validate(sched.with_actions(rows))
    assert not oracle_valid(sched.with_actions(rows))


def test_per_microbatch_kinds_need_a_microbatch() -> None:
    sched = build_schedule("1f1b", 2, 1)
    rows = [list(r) for r in sched.actions]
    rows[0].insert(1, Action(0, "F"))  # a stray forward without a microbatch needs nothing on stage 0
    with pytest.raises(ValidationError, match="0F: F needs a microbatch index"):
        validate(sched.with_actions(rows))
    assert not oracle_valid(sched.with_actions(rows))


# ---------------------------------------------------------------------------------------------------
# codec round trips

PAYLOAD = st.text(alphabet=string.ascii_letters + string.digits + "_-.:,;()[]", min_size=1, max_size=8)
ACTIONS = st.builds(
    Action,
    stage=st.integers(0, 10**6),
    kind=st.sampled_from(sorted(CORE_KINDS)),
    microbatch=st.none() | st.integers(0, 10**6),
    payload=st.none() | PAYLOAD,
)


@given(ACTIONS)
def test_action_string_round_trip(action: Action) -> None:
    assert parse_action(str(action)) == action


@settings(max_examples=60, deadline=None)
@given(library_schedules(), st.booleans())
def test_csv_round_trip(sched: Schedule, with_comms: bool) -> None:
    compute = strip_comms(sched)
    again = from_csv(to_csv(sched, with_comms=with_comms), name=sched.name)
    assert again == (lower(sched) if with_comms else compute)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_the_fast_path_never_accepts_what_the_precise_checks_reject(case: tuple[Schedule, str]) -> None:
    """validate() skips the per-action checks when the set-level ones pass: they must agree."""
    from pipewright.deps import resolve
    from pipewright.passes.validate import _check_complete, _check_structure, _looks_valid

    sched, _ = case
    res = resolve(sched)
    if _looks_valid(sched, res):
        _check_complete(sched, _check_structure(sched, res), res)  # raises if they disagree
