"""Step time of ``pipewright train --shard-optimizer`` at dp = 4 on this CPU (gloo): the checked-out
tree, whose ZeRO-1 reduce-scatters the gradients (``runtime/parallel/zero.py``), against revision
``--before`` (default ``main``), loaded from git, whose ZeRO-1 all-reduced them; paired alternating
rounds (the order swapped every round).

Each round runs ``pipewright train`` once per tree as a subprocess (``PYTHONPATH`` = that tree's
``src``), the same flags and token file: pp = 1, dp = 4, AdamW, ``--steps`` steps. A run's step time
is the median ``step_time_s`` of its ``metrics.jsonl`` after ``--skip`` warm-up steps. Printed per
round: both medians and after/before; at the end the ratio's min / median / max over the rounds.

    PYTHONPATH=src python benchmarks/bench_zero_rs.py [--rounds 5] [--steps 12] [--hidden 256]
        [--layers 4] [--seq-len 64] [--precision fp32] [--before main]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import numpy as np

from pipewright.data.tokens import write_tokens

ROOT = Path(__file__).resolve().parents[1]


def tree_at(revision: str, into: Path) -> Path:
    """``src/`` of git ``revision`` extracted under ``into``; returns that ``src`` folder."""
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def step_time(src: Path, args: argparse.Namespace, data: Path, out: Path) -> float:
    """Median step seconds (after ``args.skip`` steps) of one ``pipewright train`` run with ``src``."""
    cmd = [
        sys.executable, "-m", "pipewright", "train", "--data", str(data), "--out", str(out), "--overwrite",
        "--pp", "1", "--dp", str(args.dp), "--shard-optimizer", "--optimizer", "adamw",
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
        "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--microbatches", "2",
        "--steps", str(args.steps), "--precision", args.precision, "--eval-every", "0",
        "--no-progress", "--no-artifacts",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows[args.skip :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--before", default="main", help="git revision whose ZeRO-1 all-reduces")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-zero-rs-"))
    data = work / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, args.vocab, 200_000), vocab_size=args.vocab)
    trees = {"before": tree_at(args.before, work / "before"), "after": ROOT / "src"}
    ratios = []
    for k in range(args.rounds):
        order = ("before", "after") if k % 2 == 0 else ("after", "before")
        times = {name: step_time(trees[name], args, data, work / f"run-{name}") for name in order}
        ratios.append(times["after"] / times["before"])
        print(f"round {k}: before {times['before']:.4f} s, after {times['after']:.4f} s, "
              f"after/before {ratios[-1]:.3f}", flush=True)  # fmt: skip
    print(
        f"after/before over {args.rounds} rounds: min {min(ratios):.3f}, median "
        f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
