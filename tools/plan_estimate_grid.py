"""The planner's estimate of each schedule against the simulator, on a grid of shapes (the table in
docs/planner.md, "How the estimate is computed").

    PYTHONPATH=src python tools/plan_estimate_grid.py [--p 4,8,16,64] [--schedules …] [--markdown]

For every schedule, p ∈ {4, 8, 16, 64}, m ∈ {p, 2p, 8p} (those the schedule accepts), communication
off and on (every transfer 0.1 of a layer's forward) and equal or uneven stages (the first stage also
runs an embedding: + 0.3 forward, + 0.3 I; the last stage an output layer and loss: + 0.8 forward,
+ 1.0 I, + 0.6 W; a stage of layers: F = I = W = 1 per rank, split over its chunks), it prints
the planner's estimate (:func:`pipewright.plan.chunked.chunked_time`, the order priced with each
stage's F, I and W) and its previous estimate — for one chunk per rank the closed form
``m·t_max + (Σ t_r − t_max)·φ`` (φ = 1, or F/(F + B) for the zero-bubble schedules), for several the
order with W priced inside I — over the full simulation (:func:`pipewright.sim.simulate` of the
lowered schedule with the same per-stage times and transfer time), then the range per schedule.
``zb-auto`` is the order its generator builds for unit costs (the planner does not estimate it: it
builds it from the best finalist's costs and simulates it).
"""

from __future__ import annotations

import argparse
import time

from pipewright.cost.base import ConstantComm
from pipewright.cost.unit import StageTimes
from pipewright.errors import PipewrightError
from pipewright.plan.chunked import chunked_time
from pipewright.schedules import build_schedule
from pipewright.schedules.registry import info
from pipewright.sim import simulate

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "dualpipev")
EMBED = (0.3, 0.3, 0.0)  # (F, I, W) the embedding adds to the first stage
HEAD = (0.8, 1.0, 0.6)  # and the output layer + loss to the last


def stage_times(n: int, v: int, uneven: bool) -> tuple[list[float], list[float], list[float]]:
    """(F, I, W) per stage of n = p·v stages: 1/v each per chunk, the ends heavier when ``uneven``."""
    f, i, w = ([1.0 / v] * n for _ in range(3))
    if uneven:
        for col, e, h in zip((f, i, w), EMBED, HEAD, strict=True):
            col[0] += e
            col[-1] += h
    return f, i, w


def closed_form(name: str, p: int, m: int, f, i, w, comm: float) -> float:
    """The one-chunk closed form the planner used before: t_r = max(F + B, transfer) per rank."""
    t = [max(f[r] + i[r] + w[r], comm if r < p - 1 else 0.0) for r in range(p)]
    phi = max(f[r] / (f[r] + i[r] + w[r]) for r in range(p)) if name.startswith("zb") else 1.0
    est = m * max(t) + (sum(t) - max(t)) * phi
    return max(est, sum(t)) if phi == 1.0 else est


def rows(names, ps, comms=(0.0, 0.1)):
    """(schedule, p, m, v, comm, uneven, simulated, estimate, previous estimate) of the grid."""
    for name in names:
        entry = info(name)
        v = 2 if entry.chunks is None else entry.default_chunks
        for p in ps:
            for m in (p, 2 * p, 8 * p):
                try:
                    sched = build_schedule(name, p, m, v)
                except PipewrightError:
                    continue  # m below the schedule's least (DualPipeV: 2p)
                for comm in comms:
                    for uneven in (False, True):
                        f, i, w = stage_times(p * v, v, uneven)
                        cost = StageTimes(f=tuple(f), i=tuple(i), w=tuple(w))
                        sim = simulate(sched, cost, comm=ConstantComm(comm)).iteration_time
                        b = [x + y for x, y in zip(i, w, strict=True)]
                        est = chunked_time(name, p, m, v, None, f, b, comm, (i, w))
                        if v == 1:
                            before = closed_form(name, p, m, f, i, w, comm)
                        else:
                            before = chunked_time(name, p, m, v, None, f, b, comm)
                        yield name, p, m, v, comm, uneven, sim, est, before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", default="4,8,16,64", help="pipeline sizes (comma-separated)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--markdown", action="store_true", help="every row as a markdown table")
    args = ap.parse_args()
    ps = [int(x) for x in args.p.split(",")]
    spread: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    if args.markdown:
        print("| schedule | p | m | v | comm | stages | simulated | estimate / sim | previous / sim |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name, p, m, v, comm, uneven, sim, est, before in rows(args.schedules.split(","), ps):
        ratio, old = est / sim, before / sim
        lo_hi = spread.setdefault(name, [ratio, ratio, old, old])
        lo_hi[:] = [min(lo_hi[0], ratio), max(lo_hi[1], ratio), min(lo_hi[2], old), max(lo_hi[3], old)]
        if args.markdown:
            shape = "uneven" if uneven else "equal"
            print(f"| {name} | {p} | {m} | {v} | {comm} | {shape} | {sim:.2f} | {ratio:.4f} | {old:.4f} |")
    print(f"\nestimate / simulated per schedule, min–max over the grid ({time.perf_counter() - t0:.0f} s):")
    print("| schedule | v | estimate / simulated | previous estimate / simulated |")
    print("|---|---|---|---|")
    for name, (lo, hi, old_lo, old_hi) in spread.items():
        print(f"| {name} | {v_of(name)} | {lo:.4f}–{hi:.4f} | {old_lo:.4f}–{old_hi:.4f} |")


def v_of(name: str) -> int:
    """The chunks per rank the grid runs ``name`` with."""
    entry = info(name)
    return 2 if entry.chunks is None else entry.default_chunks


if __name__ == "__main__":
    main()
