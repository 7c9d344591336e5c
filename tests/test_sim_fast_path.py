"""The simulator's fast path (``engine.compile_fast``: ``sim/compute_compile.py``, ``sim/lowered_compile.py``;
the loop of ``sim/fast_loop.py``) against its reference path (``sim/reference.py``: lowering,
``deps.resolve``, the validator, one lowered action at a time): on valid schedules the same lowered
schedule, program, times and metrics, to the bit; on broken ones the same verdict — the same result, or
the same error and message."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from pipewright.cost.base import FreeComm
from pipewright.cost.unit import UnitCost
from pipewright.errors import PipewrightError
from pipewright.features import library_schedules
from pipewright.features.vocab.insert import PlacementCosts, insert_vocab
from pipewright.ir import Action, B, F, Schedule, loop_placement
from pipewright.passes.grad_reduce import with_grad_reduction
from pipewright.passes.lower import lower
from pipewright.schedules import build_schedule, schedule_names
from pipewright.schedules.classic import interleaved_warmup, megatron_order
from pipewright.sim import engine, fast_loop
from pipewright.sim.compute_compile import ComputeProgram
from pipewright.sim.engine import SimResult, simulate
from pipewright.sim.pair_overlap import PairOverlapCost

LIBRARY = library_schedules()
NAMES = schedule_names(LIBRARY)


@dataclass(frozen=True)
class PairComm:
    """Transfers whose time depends on the rank pair (so links, destinations and FIFO order matter)."""

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return nbytes * (1 + (7 * src + 3 * dst) % 5) / 8

    def collective_time(self, kind, rank, nbytes, group="dp", members=()) -> float:
        return 0.5 + rank / 4


@dataclass(frozen=True)
class MessageCost(UnitCost):
    """Unit compute with messages of 2 bytes and a static memory that grows with the rank."""

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        return 2.0

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return float(rank)


COSTS = {
    "unit": (UnitCost(per_chunk=True, times={"F": 1, "B": 2, "I": 1, "W": 1}), FreeComm()),
    "links": (MessageCost(times={"F": 1.0, "B": 2.5, "I": 1.25, "W": 0.75}), PairComm()),
}


def _run(schedule: Schedule, cost, comm, *, validate: bool, iterations: int = 1):
    try:
        return simulate(schedule, cost, comm=comm, validate=validate, iterations=iterations)
    except (PipewrightError, LookupError, TypeError) as exc:  # unvalidated nonsense may fail on either path
        return type(exc).__name__, str(exc)


def _both(schedule: Schedule, cost, comm, *, validate: bool, iterations: int = 1):
    fast = _run(schedule, cost, comm, validate=validate, iterations=iterations)
    with patch.object(engine, "compile_fast", return_value=None):  # the reference path only
        slow = _run(schedule, cost, comm, validate=validate, iterations=iterations)
    return fast, slow


def _assert_same(fast, slow) -> None:
    if not isinstance(slow, SimResult):
        assert fast == slow
        return
    assert isinstance(fast, SimResult), fast
    for name in ("iteration_ends", "iteration_time", "busy", "bubble", "peak_memory", "flops", "model_flops"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert fast.schedule == slow.schedule  # the lazily lowered schedule is the one simulated
    for it in range(fast.iterations):  # bit-for-bit equal times (the compute-only loop's included)
        assert fast._times(it) == slow._times(it)
    a, b = fast._program.listed, slow._program.listed
    assert (a.offsets, a.modes, a.durs, a.links, a.num_links) == (
        b.offsets,
        b.modes,
        b.durs,
        b.links,
        b.num_links,
    )
    assert a.reqs == b.reqs


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("1f1b", 4, 8, None), ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 4, 8, None), ("zbv", 4, 8, None)],
)
@pytest.mark.parametrize("costs", sorted(COSTS))
def test_library_schedules_take_the_fast_path_and_agree(name, p, m, v, costs):
    sched = build_schedule(name, p, m, v, registry=LIBRARY)
    cost, comm = COSTS[costs]
    assert engine.compile_fast(sched, cost, comm) is not None  # not declined: the test is not vacuous
    fast, slow = _both(sched, cost, comm, validate=True, iterations=2)
    _assert_same(fast, slow)
    assert fast.timeline.spans == slow.timeline.spans


def test_per_stage_kinds_go_through_their_own_rules():
    """REDUCE_GRAD (a dp collective whose rule is a plain function) is resolved per action."""
    sched = with_grad_reduction(build_schedule("1f1b", 4, 6, registry=LIBRARY), "overlap")
    cost, comm = COSTS["links"]
    assert engine.compile_fast(sched, cost, comm) is not None
    _assert_same(*_both(sched, cost, comm, validate=True))


def test_feature_kinds_agree():
    """Vocabulary collectives span the pipeline: the fast path declines and the results are the same."""
    base = build_schedule("1f1b", 4, 8)
    unit = UnitCost(per_chunk=True, times={"F": 1.0, "B": 2.0, "VS": 0.25, "VT": 0.25, "VEF": 0.01})
    sched = insert_vocab(base, "alg1", PlacementCosts(lambda a: 1.0 if a.kind in "FBIW" else 0.25))
    assert engine.compile_fast(sched, unit, FreeComm()) is None
    _assert_same(*_both(sched, unit, FreeComm(), validate=True))


MUTATIONS = ("none", "swap", "drop", "duplicate", "microbatch", "rank", "kind", "stage", "reduce")


@st.composite
def cases(draw):
    name = draw(st.sampled_from(NAMES))
    p = draw(st.integers(1, 4))
    v = draw(st.sampled_from([None, 1, 2, 3]))
    m = draw(st.integers(1, 8))
    try:
        sched = build_schedule(name, p, m, v, registry=LIBRARY)
    except PipewrightError:
        reject()
    if draw(st.booleans()):
        sched = lower(sched)
    rows = [list(r) for r in sched.actions]
    mutation = draw(st.sampled_from(MUTATIONS))
    r = draw(st.integers(0, len(rows) - 1))
    i = draw(st.integers(0, max(len(rows[r]) - 1, 0)))
    if not rows[r]:
        mutation = "none"
    if mutation == "swap" and i + 1 < len(rows[r]):
        rows[r][i], rows[r][i + 1] = rows[r][i + 1], rows[r][i]
    elif mutation == "drop":
        del rows[r][i]
    elif mutation == "duplicate":
        rows[r].insert(draw(st.integers(0, len(rows[r]))), rows[r][i])
    elif mutation == "microbatch":
        rows[r][i] = rows[r][i]._replace(microbatch=draw(st.sampled_from([None, -1, m, 0])))
    elif mutation == "rank" and len(rows) > 1:
        rows[(r + 1) % len(rows)].append(rows[r].pop(i))
    elif mutation == "kind":
        rows[r][i] = rows[r][i]._replace(kind=draw(st.sampled_from(["X", "W", "I", "B", "SEND_F", "RECV_B"])))
    elif mutation == "stage":
        rows[r][i] = rows[r][i]._replace(stage=draw(st.sampled_from([-1, sched.num_stages, 0, 0.0])))
    elif mutation == "reduce":
        sched = with_grad_reduction(sched, draw(st.sampled_from(["after", "overlap"])))
        rows = [list(r) for r in sched.actions]
    return sched.with_actions(rows), draw(st.sampled_from(sorted(COSTS))), draw(st.booleans())


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fast_path_agrees_with_the_reference_path(case):
    sched, costs, validate = case
    cost, comm = COSTS[costs]
    _assert_same(*_both(sched, cost, comm, validate=validate))


def _rows_by_hand(name: str, p: int, m: int, v: int) -> list[list[Action]]:
    """The classic schedules' rows written out one action at a time (what the column generators of
    ``schedules/classic.py`` must equal)."""
    rows = []
    for r in range(p):
        if name == "looped-bfs":
            chunks = [c * p + r for c in range(v)]
            row = [Action(s, F, k) for s in chunks for k in range(m)]
            rows.append(row + [Action(s, B, k) for s in reversed(chunks) for k in reversed(range(m))])
            continue
        order = megatron_order(m, v, p) if name == "interleaved-1f1b" else [(k, 0) for k in range(m)]
        fwd = [Action(c * p + r, F, k) for k, c in order]
        bwd = [Action((v - 1 - c) * p + r, B, k) for k, c in order]
        if name == "interleaved-1f1b":
            warm = interleaved_warmup(p, m, v, r)
        else:
            warm = m if name == "gpipe" else min(p - r - 1, m)
        steady = [a for i in range(len(fwd) - warm) for a in (fwd[warm + i], bwd[i])]
        rows.append(fwd[:warm] + steady + bwd[len(fwd) - warm :])
    return rows


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"]),
    st.integers(1, 6),
    st.integers(1, 14),
    st.integers(1, 3),
)
def test_column_schedules_are_their_action_rows(name, p, m, v):
    """The generators emit columns; the action tuples built from them on first access are the rows
    written out by hand, and a schedule from columns equals (and pickles as) one from tuples."""
    v = v if name in ("interleaved-1f1b", "looped-bfs") else 1
    try:
        sched = build_schedule(name, p, m, v, registry=LIBRARY)
    except PipewrightError:
        reject()
    assert sched.columns is not None and sched.__dict__["_rows"] is None  # nothing built yet
    assert len(sched) == 2 * p * m * v
    rows = _rows_by_hand(name, p, m, v)
    by_hand = Schedule.build(name, m, rows, loop_placement(p, v))
    assert sched.actions == tuple(map(tuple, rows))
    assert sched == by_hand and hash(sched) == hash(by_hand)
    assert pickle.loads(pickle.dumps(sched)) == by_hand


TIMES = st.fixed_dictionaries({k: st.sampled_from([0.0, 0.3, 1.0, 1.7, 2.5]) for k in "FBIW"})


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(NAMES),
    st.integers(1, 5),
    st.integers(1, 10),
    st.sampled_from([None, 1, 2, 3]),
    TIMES,
    st.booleans(),
    st.integers(1, 3),
    st.booleans(),
)
def test_compute_only_loop_agrees_bit_for_bit(name, p, m, v, times, links, iterations, barrier):
    """The compute-only loop (sim/fast_loop.py) gives every action's start and end, the iteration ends,
    busy, bubble and memory exactly as the reference loop, on every library schedule, with free and
    with pair-dependent transfers (links shared FIFO), over several iterations with and without the
    step barrier."""
    try:
        sched = build_schedule(name, p, m, v, registry=LIBRARY)
    except PipewrightError:
        reject()
    cost = MessageCost(times=times) if links else UnitCost(per_chunk=True, times=times)
    comm = PairComm() if links else FreeComm()
    compiled = engine.compile_fast(sched, cost, comm)
    assert compiled is not None and compiled[0].steps is not None  # the compute-only loop runs it
    if not links and not name.startswith("async"):  # free transfers, every rule data
        assert isinstance(compiled[0], ComputeProgram)  # compiled from the compute actions alone
    fast = simulate(sched, cost, comm=comm, iterations=iterations, step_barrier=barrier)
    with patch.object(engine, "compile_fast", partial(engine.compile_fast, fold=False)):
        lowered = simulate(sched, cost, comm=comm, iterations=iterations, step_barrier=barrier)
    with patch.object(engine, "compile_fast", return_value=None):
        slow = simulate(sched, cost, comm=comm, iterations=iterations, step_barrier=barrier)
    _assert_same(fast, slow)
    _assert_same(lowered, slow)


def test_several_receives_and_sends_around_one_compute_action():
    """A hand-lowered schedule whose compute actions wait for two receives each and issue two sends
    each (lowering never makes these; the loop's "several" branches): the same times as per action."""
    rows = [
        [(0, F, 0), (0, F, 1), (0, "SEND_F", 0), (0, "SEND_F", 1), (0, "RECV_B", 0), (0, "RECV_B", 1)],
        [(1, "RECV_F", 0), (1, "RECV_F", 1), (1, F, 0), (1, F, 1), (1, B, 0), (1, B, 1)],
    ]
    rows[0] += [(0, B, 0), (0, B, 1)]
    rows[1] += [(1, "SEND_B", 0), (1, "SEND_B", 1)]
    sched = Schedule.build("by-hand", 2, [[Action(*a) for a in row] for row in rows], (0, 1))
    sched = sched.with_actions(sched.actions, lowered=True)
    cost, comm = COSTS["links"]
    steps = engine.compile_fast(sched, cost, comm)[0].steps
    assert len(steps.in_extra) == 2 and len(steps.post_extra) == 2
    _assert_same(*_both(sched, cost, comm, validate=True, iterations=2))


def test_simulate_command_imports_neither_torch_nor_matplotlib():
    code = (
        "import sys; from pipewright.cli import main; "
        "main(['simulate', '--schedule', 'interleaved-1f1b', '--stages', '4', '--virtual', '2', "
        "'--microbatches', '8', '--cost', 'unit', '--json']); "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib'}); "
        "sys.exit(f'imported {heavy}' if heavy else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["iteration_time_s"] > 0


def test_free_transfers_fold_into_their_compute_actions():
    """With free transfers the loop takes one event per compute action (sends folded into the action
    that issues them); a link ahead of its source rank's clock keeps the unfolded loop. Both give the
    unfolded loop's ends, clocks and link free times — and so do the steps compiled from the compute
    actions alone (sim/compute_compile.py), whose lowered steps are built only for the unfolded loop and the
    expansion to every lowered action."""
    sched = build_schedule("interleaved-1f1b", 4, 8, 2, registry=LIBRARY)
    steps = engine.compile_fast(sched, *COSTS["unit"], fold=False)[0].steps
    compute_level = engine.compile_fast(sched, *COSTS["unit"])[0].steps
    assert isinstance(compute_level, fast_loop.FoldedSteps) and steps.folded is not None
    unfolded = replace(steps, folded=None)
    links = len(steps.folded.link_src)
    for clock, link_free in (([0.0] * 4, [0.0] * links), ([3.0, 1.0, 2.0, 0.0], [5.0] * links)):
        folded_out = fast_loop.run_steps(steps, clock, link_free)
        assert len(folded_out[0]) == (len(steps.comp) if max(link_free) == 0.0 else len(steps.dur))
        full = fast_loop.run_steps(unfolded, clock, link_free)
        from_compute = fast_loop.run_steps(compute_level, clock, link_free)
        assert from_compute == folded_out
        times = [
            fast_loop.StepTimes(s, out[0], clock, link_free).expand()
            for s, out in ((steps, folded_out), (unfolded, full), (compute_level, from_compute))
        ]
        assert times[0] == times[1] == times[2] and folded_out[1:] == full[1:]


def test_several_ranks_waiting_for_one_event():
    """Two ranks blocked on the same compute action (one whose sends go to both): both wake."""
    import numpy as np

    none = np.full(6, -1, np.int32)
    steps = fast_loop.Steps(
        comp=np.arange(6), sends=np.arange(0), waits=np.arange(0), wait_in=np.arange(0),
        cuts=[0, 2, 4, 6], in1=np.array([4, -1, 0, -1, -1, 0], np.int32), in_extra={},
        dur=np.array([1.0, 2.0, 0.5, 1.5, 0.25, 3.0]), link=none, send_step=np.arange(0),
        offsets=[0, 2, 4, 6],
    )  # fmt: skip
    folded = replace(steps, folded=fast_loop.Folded(steps.in1, {}, [], []))
    expected = ([0.25 + 1.0, 3.25, 1.25 + 0.5, 3.25, 0.25, 4.25], [3.25, 3.25, 4.25], [])
    assert fast_loop.run_steps(steps, [0.0] * 3, []) == expected
    assert fast_loop.run_steps(folded, [0.0] * 3, []) == expected


def test_a_step_waiting_for_several_events():
    """A step that waits for two events (``in1`` −2), one of them ending later than its rank's clock:
    the folded loop takes the same maximum as the unfolded one."""
    import numpy as np

    steps = fast_loop.Steps(
        comp=np.arange(6), sends=np.arange(0), waits=np.arange(0), wait_in=np.arange(0),
        cuts=[0, 2, 4, 6], in1=np.array([4, -1, 0, -2, -1, 0], np.int32), in_extra={3: (4, 1)},
        dur=np.array([1.0, 2.0, 0.5, 1.5, 0.25, 3.0]), link=np.full(6, -1, np.int32),
        send_step=np.arange(0), offsets=[0, 2, 4, 6],
    )  # fmt: skip
    folded = replace(steps, folded=fast_loop.Folded(steps.in1, steps.in_extra, [], []))
    expected = ([1.25, 3.25, 1.75, 3.25 + 1.5, 0.25, 4.25], [3.25, 4.75, 4.25], [])
    assert fast_loop.run_steps(steps, [0.0] * 3, []) == expected
    assert fast_loop.run_steps(folded, [0.0] * 3, []) == expected


def _registered(name: str) -> Schedule:
    """``name`` at p = 4, m = 8 (with v = 2 where the schedule takes chunks)."""
    for v in (None, 2):
        try:
            return build_schedule(name, 4, 8, v, registry=LIBRARY)
        except PipewrightError:
            continue
    raise AssertionError(f"{name}: no shape of p = 4, m = 8 builds")


def _pairs_cost() -> PairOverlapCost:
    """Per-action compute times (F&B pairs overlapped where a schedule marks them, each action costed on
    its own everywhere): the cost model path that asks every compute action."""
    base = UnitCost(per_chunk=True, times={"F": 1.0, "B": 2.0, "I": 1.25, "W": 0.75})
    return PairOverlapCost(base, lambda a, s: {"F": 0.5, "B": 0.75, "I": 0.5}.get(a.kind, 0.0))


@pytest.mark.parametrize("variant", ["unit", "links", "pairs", "reduce", "reduce-free"])
@pytest.mark.parametrize("name", NAMES)
def test_every_registered_schedule_fast_path_equals_reference(name, variant):
    """On every registered schedule the fast path (compile_fast + the compute-only loop, where they
    apply) and the reference path (lowering, ``deps.resolve``, one lowered action at a time) give the
    same program, every action's start and end, iteration ends, busy, bubble, FLOPs and memory, to the
    bit: with free transfers, with rank-pair-dependent ones, with per-action costs (overlapped F&B
    pairs), and with a data-parallel gradient reduction (overlapped with the backward, with rank-pair
    transfers; after it, free)."""
    sched = _registered(name)
    cost, comm = COSTS.get(variant, COSTS["links"])
    if variant == "pairs":
        cost, comm = _pairs_cost(), FreeComm()
    elif variant.startswith("reduce"):  # a dp collective per stage (as sends on the rank's stream)
        sched = with_grad_reduction(sched, "overlap" if variant == "reduce" else "after")
        cost, comm = COSTS["links" if variant == "reduce" else "unit"]
    compiled = engine.compile_fast(sched, cost, comm)
    assert compiled is not None  # the fast path takes every registered schedule: the test is not vacuous
    assert compiled[0].steps is not None  # and the compute-only loop runs it (collectives: as sends)
    fast, slow = _both(sched, cost, comm, validate=True, iterations=2)
    _assert_same(fast, slow)
