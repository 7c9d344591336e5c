"""The vocabulary pass on real schedules: validity, collective order, memory (p + 2 / p + 1 on 1F1B),
bubble, and placement driven by the costs."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pipewright.cost.unit import UnitCost
from pipewright.errors import ScheduleError
from pipewright.features.vocab.insert import PlacementCosts, insert_vocab, place_variant, shift_forwards
from pipewright.features.vocab.kinds import ALL_KINDS, COLLECTIVE_KINDS, VC1, VCM, VS, VSM, VT
from pipewright.features.vocab.reference_choice import reference_candidate, simulated_span
from pipewright.ir import Action, F, peak_in_flight
from pipewright.passes.validate import validate
from pipewright.schedules.registry import build_schedule
from pipewright.sim.engine import simulate

#: a vocabulary pass costs a quarter of a rank's forward (the output layer split over p ranks)
TIMES = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "VS": 0.25, "VT": 0.25, "VEF": 0.01, "VEB": 0.01}
CASES = [
    ("1f1b", 4, 16, None),
    ("1f1b", 8, 16, None),
    ("interleaved-1f1b", 4, 16, 2),
    ("v-half", 4, 16, None),
]


def _costs(base):
    unit = UnitCost(per_chunk=True, times=TIMES)
    return unit, PlacementCosts(lambda a: unit.compute_time(a, base) if a.kind in "FBIW" else TIMES[a.kind])


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
@pytest.mark.parametrize("algorithm", ["alg1", "alg2"])
def test_inserted_schedule_is_valid_and_complete(name, p, m, v, algorithm):
    base = build_schedule(name, p, m, v)
    unit, costs = _costs(base)
    sched = validate(insert_vocab(base, algorithm, costs))
    for rank, row in enumerate(sched.actions):
        for kind in ALL_KINDS:
            if kind in (VSM, VCM) or (kind == VC1 and algorithm == "alg2"):  # VSM, VCM: naive only
                assert not any(a.kind == kind for a in row)
                continue
            mbs = [a.microbatch for a in row if a.kind == kind]
            assert mbs == list(range(m)), f"rank {rank} {kind}: {mbs}"  # each once, in order
        base_order = [a for a in base.actions[rank] if a.kind != F]
        assert [a for a in row if a.kind in ("B", "I", "W")] == base_order  # backward order kept
    # every rank issues the vocabulary collectives in one order (the validator checks it too)
    orders = {
        tuple((a.kind, a.microbatch) for a in row if a.kind in COLLECTIVE_KINDS) for row in sched.actions
    }
    assert len(orders) == 1
    # the vocabulary round trip costs little: the bubble grows by less than one S + T per rank
    base_time = simulate(base, unit).iteration_time
    time = simulate(sched, unit).iteration_time
    busy_growth = m * (TIMES["VS"] + TIMES["VT"] + 0.02)
    assert time <= base_time + busy_growth + p * (TIMES["VS"] + TIMES["VT"]) + 1e-9


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize(("algorithm", "extra"), [("alg1", 2), ("alg2", 1)])
def test_1f1b_memory_is_p_plus_barriers(p, algorithm, extra):
    """The paper's activation memory on 1F1B: p + 2 (Algorithm 1), p + 1 (Algorithm 2), against p."""
    base = build_schedule("1f1b", p, 3 * p)
    _, costs = _costs(base)
    sched = insert_vocab(base, algorithm, costs)
    assert peak_in_flight(base)[0] == p
    assert peak_in_flight(sched) == [min(Fraction(p - r + extra), 3 * p) for r in range(p)]
    assert sched.meta["vocab_shift"] == extra


def test_vhalf_memory_stays_half_of_1f1b():
    p = 8
    base = build_schedule("v-half", p, 16)
    _, costs = _costs(base)
    for algorithm in ("alg1", "alg2"):
        sched = insert_vocab(base, algorithm, costs)
        assert max(peak_in_flight(sched)) <= Fraction(p, 2) + 1


def test_placement_follows_the_costs():
    """The pass keeps the variant (forward shift, priority) with the shortest iteration on the planning
    clock of the given costs — or, on plain 1F1B, the reference implementation's order where the
    simulator predicts it no slower under those costs; different costs give different placements."""
    base = build_schedule("1f1b", 4, 12)
    _, cheap = _costs(base)
    costly = PlacementCosts(lambda a: {"F": 1.0, "B": 2.0}.get(a.kind, 3.0), {"VC0": 2.0, "VC1": 2.0})
    chosen = {}
    for label, costs in (("cheap", cheap), ("costly", costly)):
        sched = insert_vocab(base, "alg1", costs)
        spans = {
            (shift, first): place_variant(base, "alg1", costs, shift, first)
            for shift in range(3)
            for first in (True, False)
        }
        best = min(spans, key=lambda v: spans[v][1])  # the first of the shortest, as the pass tries them
        planned = spans[best][0]
        reference = reference_candidate(base, "alg1", costs, 2)
        if sched.meta["vocab_order"] == "reference":
            assert sched.actions == reference.actions
            assert simulated_span(reference, costs) <= simulated_span(planned, costs)
        else:
            assert (sched.meta["vocab_shift"], sched.meta["vocab_first"]) == best
            assert sched.actions == planned.actions
            assert reference is None or simulated_span(reference, costs) > simulated_span(planned, costs)
        chosen[label] = sched.meta["vocab_order"], sched.actions
    assert chosen["cheap"] != chosen["costly"]
    # the reference refuses an embedding forward slower than the forward (its ``f >= c``)
    assert chosen["costly"][0] == "planned" and reference_candidate(base, "alg1", costly, 2) is None


def test_reference_order_only_where_the_reference_runs():
    """Interleaved 1F1B, the naive algorithm, m <= p and an allowance below the reference's warm-up
    keep the planned order."""
    assert insert_vocab(build_schedule("1f1b", 2, 4), "alg1").meta["vocab_order"] == "reference"
    for name, p, m, v, algorithm, extra in (
        ("interleaved-1f1b", 2, 4, 2, "alg2", None),
        ("1f1b", 2, 4, None, "naive", None),
        ("1f1b", 2, 2, None, "alg2", None),
        ("1f1b", 2, 4, None, "alg1", 1),
    ):
        base = build_schedule(name, p, m, v)
        costs = None if algorithm == "naive" else _costs(base)[1]  # unit costs: the naive S in halves
        assert insert_vocab(base, algorithm, costs, extra).meta["vocab_order"] == "planned"


def test_shift_forwards_is_1f1b_with_longer_warmup():
    p, m = 4, 8
    base = build_schedule("1f1b", p, m)
    for r in range(p):
        shifted = shift_forwards(list(base.actions[r]), 2)
        warmup = next(i for i, a in enumerate(shifted) if a.kind != F)
        assert warmup == min(m, p - r - 1 + 1 + 2)  # 1F1B's warm-up + the first steady F + 2


def test_errors_name_the_fix():
    base = build_schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="alg1, alg2"):
        insert_vocab(base, "alg9")
    from pipewright.passes.lower import lower

    with pytest.raises(ScheduleError, match="before lowering"):
        insert_vocab(lower(base), "alg1")


def test_last_stage_backward_waits_for_the_input_gradient():
    base = build_schedule("1f1b", 2, 2)
    sched = insert_vocab(base, "alg2")
    spec = sched.kinds["B"]
    assert ("VC0", 1, 0, None) in spec.requires(Action(1, "B", 0), sched)
    assert ("VEC", 0, 1, None) in sched.kinds["F"].requires(Action(0, "F", 1), sched)
    assert VS in sched.kinds and VT in sched.kinds


def test_simulate_cli_vocab_parallel(capsys):
    """``simulate --vocab-parallel`` on unit costs and on the paper's model: the per-rank report shows
    the balance (equal busy time on every rank with alg2 on a model, p + 1 memory on unit costs)."""
    import json

    from pipewright.cli import main

    assert main(["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--cost", "unit",
                 "--vocab-parallel", "alg2", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert [r["peak_memory_bytes"] for r in report["per_rank"]] == [5, 4, 3, 2]
    args = ["simulate", "--schedule", "1f1b", "--model", "gpt", "--layers", "8", "--hidden", "512",
            "--heads", "8", "--vocab", "131072", "--seq-len", "512", "--gpu", "a100-80gb", "--pp", "4",
            "--gpus-per-node", "4", "--microbatches", "8", "--json"]  # fmt: skip
    busy = {}
    for option in ("none", "redistribute", "alg2"):
        assert main([*args, "--vocab-parallel", option]) == 0
        report = json.loads(capsys.readouterr().out)
        busy[option] = [r["busy_s"] for r in report["per_rank"]]
    assert max(busy["alg2"]) / min(busy["alg2"]) < 1.05
    assert max(busy["none"]) / min(busy["none"]) > 1.5


@pytest.mark.parametrize(("name", "algorithm"), [("1f1b", "alg2"), ("v-half", "alg1"), ("1f1b", "naive")])
def test_broadcast_root_does_not_wait_for_its_own_broadcast(name, algorithm):
    """S on the last stage's rank needs that rank's forward only; every other rank needs the broadcast
    (the reference: ``if not is_pipeline_last_stage(): handle.wait()``). With a slow broadcast the
    root's S starts before the broadcast ends, the others' after."""
    p = 4
    sched = insert_vocab(build_schedule(name, p, 4), algorithm)
    last = sched.num_stages - 1
    root = sched.rank_of(last)
    first = VSM if algorithm == "naive" else VS
    for r in range(p):
        home = sched.placement.index(r)
        need = sched.kinds[first].requires(Action(home, first, 1), sched)
        assert need == ((("F", last, 1, None),) if r == root else (("VBX", home, 1, None),))

    class SlowBroadcast:
        def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
            return 0.0

        def collective_time(self, op, rank, nbytes, group="dp", members=()) -> float:
            return 5.0 if op == "broadcast" else 0.0

    result = simulate(sched, UnitCost(), comm=SlowBroadcast())
    spans = {r: {(a.kind, a.microbatch): (t0, t1) for a, t0, t1 in result.spans_of(r)} for r in range(p)}
    bx = spans[0][("VBX", 0)][1]
    assert spans[root][(first, 0)][0] < bx
    assert all(spans[r][(first, 0)][0] >= bx for r in range(p) if r != root)
