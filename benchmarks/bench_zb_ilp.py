"""What zb-auto's ILP refinement (``--zb-refine``) gains over the heuristic, and what it costs.

Two sets of cases, each at memory limits p (ZB-1p) and 2p (ZB-2p, scored by its steady period as the
paper runs it with post-validation):

- small unit-cost cases: p = 4, m = 8, F:I:W = 1:1:1 and 2:2:1, transfer time 0 and 0.5, and two
  with unequal stages (a heavier first stage for the embedding, a heavier last one for the output
  layer);
- the Zero Bubble paper's Table 3–5 settings (GPT 1.5B … 28.3B on A100s, as docs/fidelity.md runs
  them), priced by the cost model: ``pipewright simulate … --schedule zb-auto --zb-memory-limit L``.

Every time is pipewright's simulator's: one iteration (limit p) or the steady period of three
iterations without an optimizer barrier (limit 2p). Prints a markdown table.

    PYTHONPATH=src python benchmarks/bench_zb_ilp.py --time-limit 60 [--paper 1.5b-m32,6.2b-m32]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

from pipewright.cli import main
from pipewright.cost.base import ConstantComm
from pipewright.cost.unit import StageTimes
from pipewright.ir import Schedule, peak_in_flight
from pipewright.passes import validate
from pipewright.schedules import ScheduleCosts, build_schedule, zb_ilp
from pipewright.sim import simulate

_RECORDS: list[zb_ilp.Refined] = []
_ORIGINAL = zb_ilp.refine


def _recording(*args, **kwargs):
    done = _ORIGINAL(*args, **kwargs)
    _RECORDS.append(done)
    return done


zb_ilp.refine = _recording  # the refinement's own report (solves, seconds) for the table


def stage_times(costs: ScheduleCosts) -> StageTimes:
    return StageTimes(f=costs.f, i=costs.i, w=costs.w)


def _time(sched: Schedule, costs: ScheduleCosts, steady: bool) -> float:
    runs = {"iterations": 3, "step_barrier": False} if steady else {}
    return simulate(sched, stage_times(costs=costs), comm=ConstantComm(costs.comm), **runs).iteration_time


def fields(c: ScheduleCosts) -> tuple:
    return (c.f, c.i, c.w, c.comm, c.memory_limit)


def small_cases() -> list[tuple[str, int, int, ScheduleCosts]]:
    p, m = 4, 8
    out = []
    for fiw in ((1.0, 1.0, 1.0), (2.0, 2.0, 1.0)):
        for comm in (0.0, 0.5):
            f, i, w = ((x,) * p for x in fiw)
            out.append(
                (f"F:I:W {fiw[0]:g}:{fiw[1]:g}:{fiw[2]:g}, comm {comm:g}", p, m, ScheduleCosts(f, i, w, comm))
            )
    unequal = ScheduleCosts((1.5, 1.0, 1.0, 1.0), (1.5, 1.0, 1.0, 1.2), (1.0, 1.0, 1.0, 0.5), 0.2)
    out.append(("unequal stages (1.5 first, 1.2 last), comm 0.2", p, m, unequal))
    small = ScheduleCosts((1.4, 1.8, 1.4), (1.3, 2.3, 1.4), (1.3, 1.7, 1.2), 0.5)
    out.append(("p = 3, m = 4, unequal stages, comm 0.5", 3, 4, small))
    skewed = ScheduleCosts((1.7, 1.2, 0.6, 1.4), (2.0, 1.2, 0.7, 1.7), (1.3, 0.9, 0.3, 0.6), 0.5)
    out.append(("p = 4, m = 6, unequal stages, comm 0.5", p, 6, skewed))
    return out


def run_small(seconds: float) -> list[str]:
    rows = []
    for label, p, m, costs in small_cases():
        for limit, name in ((p, "p"), (2 * p, "2p")):
            steady = limit >= 2 * p - 1
            base = ScheduleCosts(costs.f, costs.i, costs.w, costs.comm, limit)
            heuristic = build_schedule("zb-auto", p, m, costs=base)
            _RECORDS.clear()
            refined = validate(
                build_schedule("zb-auto", p, m, costs=ScheduleCosts(*fields(base)[:5], seconds))
            )
            assert max(peak_in_flight(refined)) <= limit
            done = _RECORDS[-1] if _RECORDS else None
            rows.append(
                _row(
                    f"{label} (m = {m})",
                    name,
                    _time(heuristic, base, steady),
                    _time(refined, base, steady),
                    done,
                )
            )
    return rows


PAPER = {
    "1.5b-m32": 8,
    "6.2b-m32": 8,
    "14.6b-m64": 16,
    "28.3b-m128": 32,
}


def run_paper(models: list[str], seconds: float) -> list[str]:
    from pipewright.cost.published_specs import COMMAND, published_spec
    from pipewright.runspec import spec_to_argv, with_values

    rows = []
    for model in models:
        p = PAPER[model]
        one_iteration = {("simulation", "iterations"): 1, ("simulation", "no_step_barrier"): False}
        spec = published_spec(f"zb-a100-{model}-zb-2p")
        spec = with_values(spec, {("schedule", "name"): "zb-auto", **one_iteration})
        argv = [COMMAND, *spec_to_argv(spec, COMMAND)]
        for limit, name in ((p, "p"), (2 * p, "2p")):
            steady = ["--iterations", "3", "--no-step-barrier"] if name == "2p" else []
            common = [*argv, "--zb-memory-limit", str(limit), *steady, "--json"]
            before = _iteration(common)
            _RECORDS.clear()
            after = _iteration([*common, "--zb-ilp-time-limit", str(seconds)])
            done = _RECORDS[-1] if _RECORDS else None
            rows.append(_row(f"GPT {model} (p = {p})", name, before * 1e3, after * 1e3, done, unit=" ms"))
    return rows


def _iteration(argv: list[str]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())["iteration_time_s"]


def _row(case: str, limit: str, before: float, after: float, done, unit: str = "") -> str:
    gain = (before - after) / before * 100
    solves = f"{done.solves if done else 0}"
    if done is not None and done.proven:
        solves += ", optimal" if done.solves else " (the start meets the lower bound)"
    seconds = f"{done.seconds:.1f}" if done else "–"
    scale = 1e3 if unit else 1.0  # the bound is in the schedule's units (s for the cost model)
    bound = f"{done.bound * scale:.4g}{unit}" if done is not None and done.bound else "–"
    return (
        f"| {case} | {limit} | {before:.4g}{unit} | {after:.4g}{unit} | {gain:.2f} % | {bound} | {solves} "
        f"| {seconds} |"
    )


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="ILP seconds per case (default 60)")
    parser.add_argument("--paper", default="", help="paper models, comma-separated (default: none)")
    parser.add_argument("--no-small", action="store_true", help="skip the small cases")
    args = parser.parse_args(argv)
    print("| case | limit | heuristic | refined | gain | lower bound | solves | ILP s |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    rows = [] if args.no_small else run_small(args.time_limit)
    for r in rows:
        print(r, flush=True)
    for r in run_paper([m for m in args.paper.split(",") if m], args.time_limit):
        print(r, flush=True)
    print(f"\n{time.time() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
