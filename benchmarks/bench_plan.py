"""Planner speed: plan GPT-3 175B on 1024 GPUs (128 nodes × 8 A100 80GB, global batch 1536).

    PYTHONPATH=src python benchmarks/bench_plan.py [--rounds 3] [--baselines]

Reports wall and CPU time (``time.process_time``; the machine is shared, so CPU time is the steadier
number) of each round: candidates enumerated, pruned by the lower bound, that do not fit, simulated,
and the plan chosen. Target: ≤ 60 s wall.
"""

from __future__ import annotations

import argparse
import time

from pipewright.models.presets import resolve_model
from pipewright.plan.report import make_plan
from pipewright.plan.search import Problem
from pipewright.topology import cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baselines", action="store_true", help="include the three baselines")
    args = parser.parse_args()
    spec = resolve_model("gpt3-175b")
    for k in range(args.rounds):
        w0, c0 = time.perf_counter(), time.process_time()
        prob = Problem(spec, cluster(128, 8, "a100-80gb"), 1536)
        result = make_plan(prob, baselines=args.baselines)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        print(
            f"round {k + 1}: wall {wall:.1f} s, cpu {cpu:.1f} s; {result.considered} candidates, "
            f"{result.pruned} pruned by the bound, {result.infeasible} do not fit, "
            f"{len(result.finalists)} simulated (+ refinement); plan {result.best.candidate.describe()} "
            f"{result.best.time:.3f} s/iteration",
            flush=True,
        )


if __name__ == "__main__":
    main()
