"""The vocabulary-parallel 1F1B pass order of the authors' code (sail-sg/VocabularyParallelism,
Algorithm 2), recorded at p = 4, m = 8 and p = 8, m = 16 by ``tools/vp_reference.py`` in
``tests/data/vp_reference_order.csv`` (pass names: ``pipewright.features.vocab.reference_order``).
``reference_order`` reproduces it exactly, and as a pipewright schedule it validates and holds the same
per-rank activation memory as ``insert_vocab``. The recorded order is also held to what the reference
needs to run: each pass once per microbatch in order, and the same sequence of collectives on the
output layer's communicator on every rank."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pipewright.errors import ScheduleError
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.reference_order import orders, reference_schedule
from pipewright.ir import peak_in_flight
from pipewright.passes.validate import validate
from pipewright.schedules import build_schedule

DATA = Path(__file__).resolve().parent / "data" / "vp_reference_order.csv"
COLLECTIVES = ("X", "EC", "EX", "C")


def _orders(p: int, m: int) -> list[list[str]]:
    with DATA.open() as fh:
        rows = [r for r in csv.DictReader(fh) if (int(r["p"]), int(r["m"])) == (p, m)]
    assert [int(r["rank"]) for r in rows] == list(range(p))
    return [r["order"].split() for r in rows]


def _kind(a: str) -> str:
    return a.rstrip("0123456789")


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16)])
def test_recorded_order_runs_every_pass_once_with_one_collective_sequence(p, m):
    orders = _orders(p, m)
    counts = {"F": m, "B": m, "S": m + 1, "C": m, "X": m + 1, "EF": m, "EC": m, "EX": m, "EB": m}
    for order in orders:
        for kind, n in counts.items():
            assert [a for a in order if _kind(a) == kind] == [f"{kind}{k}" for k in range(n)]
        assert len(order) == sum(counts.values())
    sequences = [[a for a in order if _kind(a) in COLLECTIVES] for order in orders]
    assert all(s == sequences[0] for s in sequences)
    # T(k − 1) fused with S(k): one step per microbatch and one more for T(m − 1), after the last X
    assert all(order[-2:] == [f"X{m}", f"S{m}"] for order in orders)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16)])
def test_activation_memory_per_rank_equals_the_reference(p, m):
    reference = []
    for order in _orders(p, m):
        live = peak = 0
        for a in order:
            live += {"F": 1, "B": -1}.get(_kind(a), 0)
            peak = max(peak, live)
        reference.append(peak)
    assert reference == [p + 1 - r for r in range(p)]
    ours = peak_in_flight(insert_vocab(build_schedule("1f1b", p, m), "alg2"))
    assert [int(x) for x in ours] == reference
    assert [int(x) for x in peak_in_flight(validate(reference_schedule(p, m)))] == reference


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16)])
def test_reference_order_is_reproduced_exactly(p, m):
    assert orders(p, m) == _orders(p, m)


def test_reference_order_needs_more_microbatches_than_stages():
    with pytest.raises(ScheduleError, match="0 <= rank < p < m"):
        reference_schedule(4, 4)
