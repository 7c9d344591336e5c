"""Prints or records the vocabulary-parallel 1F1B pass order of the authors' code, Algorithm 2, as
:mod:`pipewright.features.vocab.reference_order` re-states it (its docstring names the passes and how the
S passes are placed).

Usage: ``python tools/vp_reference.py -p 4 -m 8 [-f 1 -b 2]`` prints one line per rank;
``python tools/vp_reference.py --write tests/data/vp_reference_order.csv`` records p = 4, m = 8 and
p = 8, m = 16 (f = 1, b = 2) for ``tests/test_vocab_reference_order.py``.

Checked for p = 2 … 12, m = p + 1 … 3p + 2 and (f, b) ∈ {(1, 1), (1, 1.5), (1, 2), (1, 3), (2, 3),
(1, 5)}: every rank runs each pass once, in microbatch order, and every rank issues the collectives
on the output layer's communicator (X, EC, EX, C) in the same sequence, as NCCL requires.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pipewright.errors import ScheduleError
from pipewright.features.vocab.reference_order import orders

RECORDED = ((4, 8), (8, 16))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("-f", type=float, default=1.0)
    parser.add_argument("-b", type=float, default=2.0)
    parser.add_argument("--write", type=Path, help="record the RECORDED cases (f = 1, b = 2) as CSV")
    args = parser.parse_args(argv)
    if args.write:
        with args.write.open("w", newline="") as fh:
            out = csv.writer(fh, lineterminator="\n")
            out.writerow(["p", "m", "f", "b", "rank", "order"])
            for p, m in RECORDED:
                for r, row in enumerate(orders(p, m)):
                    out.writerow([p, m, 1, 2, r, " ".join(row)])
        return 0
    try:
        rows = orders(args.p, args.m, args.f, args.b)
    except ScheduleError as exc:
        parser.error(str(exc))
    for r, row in enumerate(rows):
        print(f"rank {r}: {' '.join(row)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
