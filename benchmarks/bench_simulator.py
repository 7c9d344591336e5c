"""Simulator speed: lowered actions simulated per CPU-second for big pipelines.

    python benchmarks/bench_simulator.py [--stages 64] [--virtual 4] [--microbatches 512] [--iterations 3]

Times ``simulate()`` (lowering, dependency resolution and the event loop) with unit costs, and,
separately, building the Timeline of Span objects from the result. CPU time of this process
(``time.process_time``) is reported besides wall time because the benchmark machine is shared.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from pipewright.cost import UnitCost
from pipewright.schedules import build_schedule, schedule_names
from pipewright.sim import simulate


def bench(name: str, p: int, m: int, v: int, iterations: int, repeats: int) -> dict:
    sched = build_schedule(name, p, m, v)
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        result = simulate(sched, UnitCost(per_chunk=True), iterations=iterations)
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    c0 = time.process_time()
    spans = len(result.timeline.spans)
    timeline_cpu = time.process_time() - c0
    n = result.num_actions
    return {
        "schedule": name,
        "p": p,
        "v": sched.chunks_per_rank,
        "m": m,
        "iterations": iterations,
        "actions": n,
        "cpu_s": best_cpu,
        "wall_s": best_wall,
        "actions_per_cpu_s": n / best_cpu,
        "actions_per_wall_s": n / best_wall,
        "timeline_cpu_s": timeline_cpu,
        "spans": spans,
        "iteration_time": result.iteration_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--virtual", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {sys.platform}"
    print(f"python {platform.python_version()} on {machine}")
    cases = [("1f1b", 1), ("interleaved-1f1b", args.virtual)]
    cases += [(n, 1) for n in ("zb-h1", "zb-h2") if n in schedule_names()]
    for name, v in cases:
        r = bench(name, args.stages, args.microbatches, v, args.iterations, args.repeats)
        print(
            f"{r['schedule']:>17} p={r['p']} v={r['v']} m={r['m']} × {r['iterations']} it: "
            f"{r['actions']:>9,} actions, {r['cpu_s']:.2f} s CPU ({r['wall_s']:.2f} s wall) → "
            f"{r['actions_per_cpu_s']:,.0f} actions/CPU-s ({r['actions_per_wall_s']:,.0f}/wall-s); "
            f"timeline {r['spans']:,} spans in {r['timeline_cpu_s']:.2f} s CPU"
        )


if __name__ == "__main__":
    main()
