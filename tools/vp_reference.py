"""Prints, checks or records the vocabulary-parallel 1F1B pass order of the authors' code (Algorithm 1 or
2), as :mod:`pipewright.features.vocab.reference_order` re-states it (its docstring names the passes and
how the S passes are placed) or as the authors' function itself issues it (``--reference CHECKOUT``: a
checkout of sail-sg/VocabularyParallelism, run on stand-ins by ``tools/vp_trace.py``).

Usage:

- ``python tools/vp_reference.py -p 4 -m 8 [-f 1 -b 2] [--algorithm alg1]``: one line per rank, from
  the re-statement (with ``--reference CHECKOUT``: from the authors' function);
- ``python tools/vp_reference.py --reference CHECKOUT --check``: the re-statement against the authors'
  function for p = 2 … 9, m = p + 1 … 3p + 2, (f, b) ∈ {(1, 2), (1, 1), (1, 1.5), (1, 3), (2, 3), (1, 5)},
  both algorithms; prints the cases that differ and exits 1 if any does;
- ``python tools/vp_reference.py --reference CHECKOUT --write tests/data/vp_reference_order.csv``:
  records the authors' order at p = 4, m = 8 and p = 8, m = 16 (f = 1, b = 2), both algorithms, for
  ``tests/test_vocab_reference_order.py``.

Checked on 26 Nov 2026 against sail-sg/VocabularyParallelism at 6191c3bf: the re-statement equals the
authors' order in all 1,248 cases of ``--check``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vp_trace import trace

from pipewright.errors import ScheduleError
from pipewright.features.vocab.reference_order import REFERENCE_ALGORITHMS, orders

RECORDED = ((4, 8), (8, 16))
TIMES = ((1.0, 2.0), (1.0, 1.0), (1.0, 1.5), (1.0, 3.0), (2.0, 3.0), (1.0, 5.0))


def _reference(checkout: Path, p: int, m: int, f: float, b: float, algorithm: str) -> list[list[str]]:
    c = 0.0 if (f, b) == (1.0, 2.0) else min(f, 0.5)  # any embedding time with f >= c
    return trace(checkout, p, m, fused=algorithm == "alg2", f=f, b=b, c=c)


def check(checkout: Path) -> int:
    """Cases where the re-statement differs from the authors' function (printed)."""
    bad = 0
    for algorithm in REFERENCE_ALGORITHMS:
        for p in range(2, 10):
            for m in range(p + 1, 3 * p + 3):
                for f, b in TIMES:
                    if orders(p, m, f, b, algorithm) != _reference(checkout, p, m, f, b, algorithm):
                        bad += 1
                        print(f"differs: {algorithm} p={p} m={m} f={f} b={b}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("-f", type=float, default=1.0)
    parser.add_argument("-b", type=float, default=2.0)
    parser.add_argument("--algorithm", choices=REFERENCE_ALGORITHMS, default="alg2")
    parser.add_argument("--reference", type=Path, help="a checkout of sail-sg/VocabularyParallelism")
    parser.add_argument("--check", action="store_true", help="the re-statement against --reference")
    parser.add_argument("--write", type=Path, help="record the RECORDED cases from --reference as CSV")
    args = parser.parse_args(argv)
    if (args.check or args.write) and args.reference is None:
        parser.error("--check and --write need --reference CHECKOUT")
    if args.check:
        bad = check(args.reference)
        print(f"{bad} case(s) differ")
        return 1 if bad else 0
    if args.write:
        with args.write.open("w", newline="") as fh:
            out = csv.writer(fh, lineterminator="\n")
            out.writerow(["algorithm", "p", "m", "f", "b", "rank", "order"])
            for algorithm in REFERENCE_ALGORITHMS:
                for p, m in RECORDED:
                    for r, row in enumerate(_reference(args.reference, p, m, 1.0, 2.0, algorithm)):
                        out.writerow([algorithm, p, m, 1, 2, r, " ".join(row)])
        return 0
    try:
        if args.reference is not None:
            rows = _reference(args.reference, args.p, args.m, args.f, args.b, args.algorithm)
        else:
            rows = orders(args.p, args.m, args.f, args.b, args.algorithm)
    except ScheduleError as exc:
        parser.error(str(exc))
    for r, row in enumerate(rows):
        print(f"rank {r}: {' '.join(row)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
