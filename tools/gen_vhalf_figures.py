"""V-Half before and after the squeeze: the bubble and memory table of docs/schedules-vshape (printed as
Markdown) and the timeline picture docs/img/vhalf_squeeze.png.

PYTHONPATH=src python tools/gen_vhalf_figures.py

Bubble = iteration time − m·(F + I + W) of a rank's layers, one iteration alone, free communication;
1F1B runs the same layers as one stage per rank. Memory = the simulator's peak activation memory
(:func:`pipewright.sim.memory.peak_memory`) in microbatches of a rank's layers, max over ranks.
"""

from __future__ import annotations

from pathlib import Path

from pipewright.cost import UnitCost
from pipewright.ir import Schedule
from pipewright.schedules import build_schedule
from pipewright.schedules.vshape import v_half_blocks
from pipewright.sim import simulate
from pipewright.sim.memory import peak_memory
from pipewright.viz import draw_timeline

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
#: F : I : W of a rank's layers — equal, and about the Zero Bubble paper's profiles of its 1.5B model
#: (T_F, T_B, T_W = 18.5, 18.1, 9.3 ms: 2 : 2 : 1) and its 6.2B model (29.7, 29.4, 19.9 ms: 3 : 3 : 2)
RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "2:2:1": (2.0, 2.0, 1.0), "3:3:2": (3.0, 3.0, 2.0)}


def _cost(f: float, i: float, w: float, v: int) -> UnitCost:
    return UnitCost(times={"F": f, "I": i, "W": w, "B": i + w}, per_chunk=True, activation=1 / v)


def measure(sched: Schedule, f: float, i: float, w: float) -> tuple[float, float]:
    """(bubble, peak activation memory in microbatches of a rank's layers) of one iteration."""
    cost = _cost(f, i, w, sched.chunks_per_rank or 1)
    result = simulate(sched, cost)
    return result.iteration_time - sched.num_microbatches * (f + i + w), max(
        peak_memory(result.timeline, sched, cost)
    )


def table() -> str:
    lines = [
        "| F:I:W | p | m | 1F1B bubble | V-Half blocks (/ 1F1B) | V-Half squeezed | squeezed / 1F1B "
        "| memory 1F1B / blocks / squeezed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (f, i, w) in RATIOS.items():
        for p in (4, 8, 16):
            for m in (2 * p, 4 * p, 8 * p):
                full, mem_full = measure(build_schedule("1f1b", p, m), f, i, w)
                blocks, mem_blocks = measure(v_half_blocks(p, m), f, i, w)
                half, mem_half = measure(build_schedule("v-half", p, m), f, i, w)
                lines.append(
                    f"| {label} | {p} | {m} | {full:g} | {blocks:g} ({blocks / full:.3f}) | {half:g} | "
                    f"{half / full:.3f} | {mem_full:g} / {mem_blocks:g} / {mem_half:g} |"
                )
    return "\n".join(lines)


def picture() -> None:
    p, m = 4, 8
    cost = _cost(1.0, 1.0, 1.0, 2)
    timelines, titles = [], []
    cases = (("blocks (before)", v_half_blocks(p, m)), ("squeezed", build_schedule("v-half", p, m)))
    for label, sched in cases:
        result = simulate(sched, cost)
        timelines.append(result.timeline)
        titles.append(
            f"v-half {label}: p={p}, m={m}, F=I=W=1 per rank — iteration {result.iteration_time:g}, "
            f"bubble {result.iteration_time - 3 * m:g} (1F1B: {3 * (p - 1)}); peak "
            f"{max(peak_memory(result.timeline, sched, cost)):g} microbatches (1F1B: {p})"
        )
    IMG.mkdir(parents=True, exist_ok=True)
    draw_timeline(timelines, IMG / "vhalf_squeeze.png", titles=titles, xlabel="time (unit costs)")


if __name__ == "__main__":
    print(table())
    picture()
