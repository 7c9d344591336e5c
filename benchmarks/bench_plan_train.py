"""A plan for local CPU processes, trained: measured step time of `train --plan` next to the uniform layout.

    PYTHONPATH=src python benchmarks/bench_plan_train.py [--rounds 3] [--steps 12]

Makes two plans with `pipewright plan --gpu cpu` for gpt-small-cpu (8 layers) on 4 processes, global
batch 16: the free plan, and the plan with pp fixed to 4; then trains, alternating, (a) the free plan,
(b) the pp = 4 plan and (c) the uniform layout with pp = 4, 1F1B, b = 1 (what one would write by hand),
and reports the median step time (steps after the first) of each run and its ratio to (c) in the same
round. The machine is shared: compare within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--model", "gpt-small-cpu", "--layers", "8"]
PLAN = [*MODEL, "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "16",
        "--max-tp", "1", "--no-progress"]  # fmt: skip


def _cli(*args: str) -> str:
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "pipewright", *args], capture_output=True, text=True, env=env, check=True
    )
    return out.stdout


def _median_step(out_dir: Path) -> float:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return statistics.median(r["step_time_s"] for r in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_plan_train_"))
    free, pp4 = tmp / "free.json", tmp / "pp4.json"
    _cli("plan", *PLAN, "-o", str(free))
    _cli("plan", *PLAN, "--pp", "4", "-o", str(pp4))
    runs = {
        "plan (free)": ["--plan", str(free)],
        "plan (pp=4)": ["--plan", str(pp4)],
        "uniform pp=4 1f1b": [
            *MODEL,
            "--pp",
            "4",
            "--schedule",
            "1f1b",
            "--microbatches",
            "16",
            "--microbatch-size",
            "1",
        ],
    }
    for name, path in (("free", free), ("pp4", pp4)):
        data = json.loads(path.read_text())
        print(f"plan {name}: t={data['tp']} p={data['pp']} d={data['dp']} b={data['microbatch_size']} "
              f"{data['schedule']} layout {data['layout']}")  # fmt: skip
    for k in range(args.rounds):
        times = {}
        for name, flags in runs.items():
            out = tmp / f"r{k}-{name.replace(' ', '_')}"
            _cli("train", *flags, "--steps", str(args.steps), "--out", str(out), "--no-progress",
                 "--no-artifacts")  # fmt: skip
            times[name] = _median_step(out)
        base = times["uniform pp=4 1f1b"]
        print(
            f"round {k + 1}: "
            + ", ".join(f"{n} {1000 * t:.0f} ms ({t / base:.2f}× uniform)" for n, t in times.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
