"""A plan for local CPU processes, trained: measured step time of `train --plan` next to the uniform layout.

    PYTHONPATH=src python benchmarks/bench_plan_train.py [--rounds 5] [--steps 20]

The model (gpt-small-cpu with 12 layers and an 8192-token vocabulary: the output layer and its loss
weigh several transformer layers: ≈ 4 in the cpu cost model, ≈ 7 in a profile taken here) makes the last
pipeline stage heavy, so the planner moves layers off it. ``pipewright plan --gpu cpu`` plans it for two
local processes with pp = 2 (the schedules 1F1B, ZB-H1 and the cost-fitted zb-auto order); the uniform
layout is what one writes by hand: ``train --pp 2 --schedule 1f1b`` with the plan's microbatch size and
count (half the layers on each stage). Each round trains both, alternating which goes first (ABBA), and
takes each run's median step time after the first step. Reported: every round's times and uniform/plan
ratio, the ratio of the medians over all rounds, the spread of the per-round ratios, the ratio of the
fastest steps (the least disturbed by other load) and the load average before and after.
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


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipewright", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"pipewright {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def _steps(out_dir: Path) -> list[float]:
    """Step times after the first (warm-up) step."""
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["step_time_s"] for r in rows[1:]]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args()
    model = ["--model", "gpt-small-cpu", "--layers", str(args.layers), "--vocab", str(args.vocab)]
    tmp = Path(tempfile.mkdtemp(prefix="bench_plan_train_"))
    plan_path = tmp / "plan.json"
    print(_cli("plan", *model, "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--pp", "2",
               "--max-tp", "1", "--schedules", "1f1b,zb-h1,zb-auto", "--global-batch-size",
               str(args.global_batch_size), "--no-progress", "-o", str(plan_path)))  # fmt: skip
    plan = json.loads(plan_path.read_text())
    b, m = plan["microbatch_size"], plan["microbatches"]
    runs = {
        "plan": ["--plan", str(plan_path)],
        "uniform": [
            *model,
            "--pp",
            "2",
            "--schedule",
            "1f1b",
            "--microbatch-size",
            str(b),
            "--microbatches",
            str(m),
        ],
    }
    print(f"plan: {plan['schedule']} b={b} m={m} layout {plan['layout']}; uniform: 1f1b b={b} m={m}")
    load_before = _load()
    times: dict[str, list[float]] = {name: [] for name in runs}
    best: dict[str, list[float]] = {name: [] for name in runs}
    ratios = []
    for k in range(args.rounds):
        order = list(runs) if k % 2 == 0 else list(runs)[::-1]
        for name in order:
            out = tmp / f"r{k}-{name}"
            _cli("train", *runs[name], "--steps", str(args.steps), "--eval-every", "0", "--out", str(out),
                 "--no-progress", "--no-artifacts")  # fmt: skip
            steps = _steps(out)
            times[name].append(statistics.median(steps))
            best[name].append(min(steps))
        ratios.append(times["uniform"][-1] / times["plan"][-1])
        print(f"round {k + 1} ({'-'.join(order)}): plan {1000 * times['plan'][-1]:.0f} ms, uniform "
              f"{1000 * times['uniform'][-1]:.0f} ms, uniform/plan {ratios[-1]:.3f}  (load {_load()})",
              flush=True)  # fmt: skip
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"median step: plan {1000 * med['plan']:.0f} ms, uniform {1000 * med['uniform']:.0f} ms; "
        f"ratio of medians uniform/plan {med['uniform'] / med['plan']:.3f}; per-round ratios "
        f"{min(ratios):.3f}–{max(ratios):.3f} (median {statistics.median(ratios):.3f}); fastest step "
        f"uniform/plan {min(best['uniform']) / min(best['plan']):.3f}; "
        f"load average before {load_before}, after {_load()}; predicted plan "
        f"{plan['predicted']['iteration_time_s'] * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
