"""The vocabulary-parallel 1F1B pass order of the authors' code (sail-sg/VocabularyParallelism,
Algorithms 1 and 2), recorded at p = 4, m = 8 and p = 8, m = 16 by running the authors' function on
stand-ins (``tools/vp_reference.py --reference CHECKOUT --write``) in
``tests/data/vp_reference_order.csv`` (pass names: ``pipewright.features.vocab.reference_order``).
``reference_order`` reproduces it exactly, and as a pipewright schedule it validates and holds the same
per-rank activation memory as ``insert_vocab``. The recorded order is also held to what the reference
needs to run: each pass once per microbatch in order, and the same sequence of collectives on the
output layer's communicator on every rank."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pipewright.cost.unit import UnitCost
from pipewright.errors import ScheduleError
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.kinds import VBX, VS
from pipewright.features.vocab.reference_order import COLLECTIVES, orders, reference_schedule
from pipewright.ir import peak_in_flight
from pipewright.passes.validate import validate
from pipewright.schedules import build_schedule
from pipewright.sim.engine import simulate

DATA = Path(__file__).resolve().parent / "data" / "vp_reference_order.csv"
CASES = [(alg, p, m) for alg in ("alg1", "alg2") for p, m in ((4, 8), (8, 16))]


def _orders(algorithm: str, p: int, m: int) -> list[list[str]]:
    with DATA.open() as fh:
        rows = [
            r for r in csv.DictReader(fh) if (r["algorithm"], int(r["p"]), int(r["m"])) == (algorithm, p, m)
        ]
    assert [int(r["rank"]) for r in rows] == list(range(p))
    return [r["order"].split() for r in rows]


def _kind(a: str) -> str:
    return a.rstrip("0123456789")


@pytest.mark.parametrize(("algorithm", "p", "m"), CASES)
def test_recorded_order_runs_every_pass_once_with_one_collective_sequence(algorithm, p, m):
    recorded = _orders(algorithm, p, m)
    counts = {"F": m, "B": m, "S": m + 1, "C": m, "X": m + 1, "EF": m, "EC": m, "EX": m, "EB": m}
    if algorithm == "alg1":
        counts["G"] = m  # the SUM of ∇X after each T
    for order in recorded:
        for kind, n in counts.items():
            assert [a for a in order if _kind(a) == kind] == [f"{kind}{k}" for k in range(n)]
        assert len(order) == sum(counts.values())
    sequences = [[a for a in order if _kind(a) in COLLECTIVES] for order in recorded]
    assert all(s == sequences[0] for s in sequences)
    if algorithm == "alg2":  # T(m − 1) alone, after the last X, ends every rank
        assert all(order[-2:] == [f"X{m}", f"S{m}"] for order in recorded)


@pytest.mark.parametrize(("algorithm", "p", "m"), CASES)
def test_activation_memory_per_rank_equals_the_reference(algorithm, p, m):
    reference = []
    for order in _orders(algorithm, p, m):
        live = peak = 0
        for a in order:
            live += {"F": 1, "B": -1}.get(_kind(a), 0)
            peak = max(peak, live)
        reference.append(peak)
    extra = 2 if algorithm == "alg1" else 1  # the paper's p + 2 and p + 1
    assert reference == [p + extra - r for r in range(p)]
    ours = peak_in_flight(insert_vocab(build_schedule("1f1b", p, m), algorithm))
    assert [int(x) for x in ours] == reference
    sched = validate(reference_schedule(p, m, algorithm=algorithm))
    assert [int(x) for x in peak_in_flight(sched)] == reference


@pytest.mark.parametrize(("algorithm", "p", "m"), CASES)
def test_reference_order_is_reproduced_exactly(algorithm, p, m):
    assert orders(p, m, algorithm=algorithm) == _orders(algorithm, p, m)


def test_reference_order_needs_more_microbatches_than_stages_and_a_reference_algorithm():
    with pytest.raises(ScheduleError, match="0 <= rank < p < m"):
        reference_schedule(4, 4)
    with pytest.raises(ScheduleError, match="the reference implements alg1 and alg2, not 'naive'"):
        reference_schedule(4, 8, algorithm="naive")


def test_a_collective_starts_when_its_last_member_issued_it_and_only_its_consumers_wait():
    """The simulator's rule for the vocabulary collectives, as the runtime issues them and as the
    reference's NCCL streams run them: a rank issues a collective where it reaches it in its order and
    goes on computing; the collective starts when every member has issued it; only an action that
    needs its result waits. The broadcast root's S needs only its own forward."""
    p, m = 4, 8
    result = simulate(reference_schedule(p, m), UnitCost())
    rows = [result.spans_of(rank) for rank in range(p)]
    compute = result.schedule.kinds
    for k in range(m):
        issued, starts = [], set()
        for row in rows:
            i = next(i for i, (a, _, _) in enumerate(row) if (a.kind, a.microbatch) == (VBX, k))
            before = [e for a, _, e in row[:i] if compute[a.kind].compute]
            issued.append(before[-1] if before else 0.0)
            starts.add(row[i][1])
        assert starts == {max(issued)}  # one start, when the last member issued it
        end = max(issued)  # free under unit costs
        for rank, row in enumerate(rows):
            s_start = next(s for a, s, _ in row if (a.kind, a.microbatch) == (VS, k))
            if rank == p - 1:
                assert s_start == _previous_compute_end(row, VS, k)  # the root never waits for X
            else:
                assert s_start >= end
    root = rows[p - 1]
    assert next(s for a, s, _ in root if (a.kind, a.microbatch) == (VS, 0)) < next(
        s for a, s, _ in root if (a.kind, a.microbatch) == (VBX, 0)
    )


def _previous_compute_end(row, kind: str, k: int) -> float:
    i = next(i for i, (a, _, _) in enumerate(row) if (a.kind, a.microbatch) == (kind, k))
    return max((e for a, _, e in row[:i] if a.kind in ("F", "B", "VS", "VT", "VEF", "VEB")), default=0.0)
