"""Runtime vs simulator: measured step time / predicted step time for 1F1B, interleaved 1F1B (v = 2) and
ZB-H1 at p = 2 and p = 4 on this machine.

Model: GPT, 8 layers, h = 256, 4 heads, FFN 1024, sequence 128, vocabulary 256 (bytes), microbatch
size 2 — one layer's forward takes ≈ 5 ms on one CPU thread, so the executor's per-action overhead
(≈ 0.1 ms) is small against compute. m = 8 microbatches, 20 training steps per case (the first third
is warm-up). Each case runs as ``pipewright train --compare-sim`` does: profiled in-process right
before the run and again right after it, with as many measuring processes as the run has workers, at
most one per core (``compare.profile_workers``), predicted from the mean of the two profiles
(``compare.bracket_profile``); when the run has more workers than cores the prediction shares the
cores among the pipeline ranks (processor sharing, ``pipewright.sim.sharing``). Measured: the median
step after the first third.

This VM's speed shifts by up to ±25 % for seconds at a time, even with one process running (its host's
load; a level shift in a step series, and between two profiles: ``profile_drift``), so one profile
catches one moment while the run's median spans ~15 s: the two bracketing profiles average over the
run's span. Every case runs once per round; rounds repeat that.

    PYTHONPATH=src python benchmarks/bench_sim_vs_measured.py [--rounds 2] [--steps 20] [--out DIR]
        [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pipewright.cost.profiled import load_profile
from pipewright.runtime.profiling.compare import bracket_profile, compare_run, plan_comparison, with_brackets
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import train

MODEL = {"model": "gpt", "layers": 8, "hidden": 256, "heads": 4, "vocab": 256, "seq_len": 128}
CASES = (("1f1b", 2, None), ("interleaved-1f1b", 2, 2), ("zb-h1", 2, None))
CASES += (("1f1b", 4, None), ("interleaved-1f1b", 4, 2), ("zb-h1", 4, None))


def _config(schedule: str, pp: int, virtual: int | None, steps: int, out: Path) -> TrainConfig:
    return TrainConfig(
        **MODEL,
        schedule=schedule,
        pp=pp,
        virtual=virtual,
        microbatches=8,
        microbatch_size=2,
        steps=steps,
        warmup=2,
        eval_every=0,
        progress=False,
        out=str(out),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/bench-sim-vs-measured")
    parser.add_argument(
        "--report-only", action="store_true", help="recompute the reports of the runs already in --out"
    )
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for schedule, pp, v in CASES:
            name = f"{schedule} p={pp}" + (f" v={v}" if v else "")
            out = root / f"round{rnd}-{schedule}-p{pp}"
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            config = _config(schedule, pp, v, args.steps, out)
            if args.report_only and not (out / "profile-after.csv").is_file():  # an older run: one profile
                plan = plan_comparison(config, str(out / "profile.csv"), progress=False)
            elif args.report_only:  # the two profiles the run wrote, merged again
                before, after = (load_profile(out / f"profile-{w}.csv") for w in ("before", "after"))
                plan = plan_comparison(config, str(out / "profile-before.csv"), progress=False)
                plan = with_brackets(plan, before, after)
            else:  # as `pipewright train --compare-sim`: profiled before and after the run
                plan = plan_comparison(config, progress=False)
                train(config)
                (out / "load_average.txt").write_text(f"{os.getloadavg()[0]}")
                plan = bracket_profile(plan, progress=False)
            report = compare_run(plan, out)
            load = out / "load_average.txt"
            report["load_average"] = float(load.read_text()) if load.is_file() else float("nan")
            results.setdefault(name, []).append(report)
            print(
                f"round {rnd} {name}: measured {report['measured']['step_time_s'] * 1e3:.1f} ms, predicted "
                f"{report['predicted']['step_time_s'] * 1e3:.1f} ms, ratio {report['ratio']:.3f}, profile "
                f"drift {report.get('profile_drift', {}).get('F', float('nan')):.2f}, replay "
                f"{report['replay']['ratio']:.3f}, compute {report['compute_ratio']} "
                f"(bubble {report['measured']['bubble_fraction']:.3f} vs "
                f"{report['predicted']['bubble_fraction']:.3f}; {time.perf_counter() - t0:.0f} s, "
                f"load {report['load_average']:.1f})",
                flush=True,
            )
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nmachine: {os.cpu_count()} CPUs, load average now {os.getloadavg()[0]:.1f}")
    print(
        "| schedule | measured step (ms) | predicted step (ms) | measured / predicted (each round) |"
        " profile drift after/before (F) |"
        " F ran x profiled | replay: executor / simulated | bubble measured / predicted |"
    )
    print("|---|---:|---:|---|---|---|---|---|")
    med = statistics.median
    for name, reps in results.items():
        ms = med(r["measured"]["step_time_s"] for r in reps) * 1e3
        ps = med(r["predicted"]["step_time_s"] for r in reps) * 1e3
        ratios = ", ".join(f"{r['ratio']:.2f}" for r in reps)
        drift = ", ".join(f"{r.get('profile_drift', {}).get('F', float('nan')):.2f}" for r in reps)
        slow = ", ".join(f"{r['compute_ratio']['F']:.2f}" for r in reps)
        replay = ", ".join(f"{r['replay']['ratio']:.2f}" for r in reps)
        mb = med(r["measured"]["bubble_fraction"] for r in reps)
        pb = med(r["predicted"]["bubble_fraction"] for r in reps)
        print(
            f"| {name} | {ms:.0f} | {ps:.0f} | {ratios} | {drift} | {slow} | {replay} | {mb:.3f} / {pb:.3f} |"
        )


if __name__ == "__main__":
    main()
