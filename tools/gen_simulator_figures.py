"""Regenerate the timeline pictures of docs/simulator.md (unit costs, free communication).

PYTHONPATH=src python tools/gen_simulator_figures.py
"""

from __future__ import annotations

from pathlib import Path

from pipewright.cost import UnitCost
from pipewright.schedules import build_schedule
from pipewright.sim import simulate
from pipewright.viz import draw_timeline

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
XLABEL = "time (unit costs)"
COST = UnitCost(per_chunk=True)  # a rank's share of F, I, W costs 1 whatever v is; B = 2


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    p, m = 4, 8
    timelines, titles = [], []
    for name in ("1f1b", "zb-h1", "zbv"):
        result = simulate(build_schedule(name, p, m), COST)
        timelines.append(result.timeline)
        titles.append(
            f"{name}: p={p}, m={m}, F=I=W=1 per rank — iteration {result.iteration_time:g}, "
            f"bubble per rank {max(result.bubble):g}"
        )
    draw_timeline(timelines, IMG / "sim_1f1b_zbh1_zbv.png", titles=titles, xlabel=XLABEL)

    timelines, titles = [], []
    for name in ("zb-h2", "zbv"):
        for barrier in (True, False):
            result = simulate(build_schedule(name, p, m), COST, iterations=3, step_barrier=barrier)
            timelines.append(result.timeline)
            titles.append(
                f"{name} × 3 iterations, {'with' if barrier else 'without'} step barrier — "
                f"period {result.iteration_time:g}"
            )
    draw_timeline(timelines, IMG / "sim_step_barrier.png", titles=titles, xlabel=XLABEL)


if __name__ == "__main__":
    main()
