"""The per-rank pass order of the vocabulary-parallel 1F1B schedule that the authors' code runs
(Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism", arXiv 2411.05288;
sail-sg/VocabularyParallelism, ``megatron/core/pipeline_parallel/vocab_parallel_schedule.py``,
``forward_backward_pipelining_with_vocab_parallel``), Algorithm 2 (its default, backward fusion on).

Our own re-statement of that function's control flow, with each pass recorded instead of run:

- ``F{k}`` / ``B{k}``: the transformer stage's forward / backward of microbatch k (on the last rank
  B(k) also computes the loss and broadcasts X(k + 1) with ∇loss(k); after B(m − 1) the last
  broadcast, ∇loss(m − 1) alone, is issued at the end);
- ``X{k}``: the broadcast of X(k) (and ∇loss(k − 1)) is issued: on the last rank right after F(0) and
  B(k − 1) (the root does not wait for it), on the others where the reference posts the receive;
- ``S{k}``: the output-layer step of microbatch k, fused: T(k − 1) then S(k) (``S{m}``: T(m − 1) only);
- ``C{k}``: the reduction issued after ``S{k}`` (statistics and the SUM of the rescaled ∇X);
- ``EF{k}`` / ``EC{k}``: the embedding forward's compute / its SUM to stage 0;
- ``EX{k}`` / ``EB{k}``: the embedding backward's broadcast of ∇ from stage 0 / its compute.

Where the S passes go is fixed per rank from the pass times f (forward), b (backward) and c (the
reference's third timer; it only has to satisfy f ≥ c): walking from the last rank to the first, the
offset between the rank's S and its own 1F1B slot either drops by f (S stays before the forward, "BSF")
or, when that would pass −b, the rank runs S after its forward ("BFS") and the offset grows by b − f.
Without profiled timers the reference takes f = 1, b = 2, c = 0.

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
