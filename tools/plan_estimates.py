"""The planner's closed-form estimate against the full simulation of the same layout, on the finalists
of three planning problems (the table in docs/planner.md, "The estimate against the simulation").

    PYTHONPATH=src python tools/plan_estimates.py [405b|mixtral|gpt3 ...]

Each problem is planned as ``pipewright plan`` plans it (the default search, no baselines); for every
finalist the estimate (``Evaluated.estimate``) and the simulated iteration time of the same partition
and mapping (before the refinement moves layers) are printed with their ratio, and the estimated peak
memory over the simulated one.
"""

from __future__ import annotations

import sys
import time

PROBLEMS = {
    "405b": "--model llama3-405b --gpu h100-sxm --nodes 2048 --gpus-per-node 8 --global-batch-size 2048",
    "mixtral": "--model mixtral-8x7b --gpu h100-sxm --nodes 8 --gpus-per-node 8 --global-batch-size 256",
    "gpt3": "--model gpt3-175b --gpu a100-80gb --nodes 128 --gpus-per-node 8 --global-batch-size 1536",
}


def finalists(argv: list[str]) -> list[tuple[str, float, float, float, float]]:
    """(candidate, estimate s, simulated s, estimated peak bytes, simulated peak bytes) of each
    finalist ``pipewright plan argv`` simulates."""
    import contextlib
    import io

    import pipewright.plan.search as search
    from pipewright.cli import main

    rows: list[tuple[str, float, float, float, float]] = []
    simulate = search.simulate_plan

    def recorded(prob, ev):
        est = ev.estimate
        out = simulate(prob, ev)
        rows.append((ev.candidate.describe(), est, out.simulated, ev.peak_memory, out.simulated_memory))
        return out

    search.simulate_plan = recorded
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(["plan", *argv, "--no-baselines", "--no-progress"])
    finally:
        search.simulate_plan = simulate
    return rows


def main() -> None:
    names = sys.argv[1:] or list(PROBLEMS)
    for name in names:
        t0 = time.perf_counter()
        rows = finalists(PROBLEMS[name].split())
        print(f"## {name}: pipewright plan {PROBLEMS[name]} ({time.perf_counter() - t0:.0f} s)")
        print("| finalist | estimate s | simulated s | time est/sim | memory est/sim |")
        print("|---|---|---|---|---|")
        for config, est, sim, mem, peak in rows:
            print(f"| {config} | {est:.3f} | {sim:.3f} | {est / sim:.3f} | {mem / peak:.3f} |")


if __name__ == "__main__":
    main()
