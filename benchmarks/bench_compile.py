"""``--compile`` against eager: step time of ``pipewright train`` with torch.compile per stage over the same
run without it, side by side.

For each schedule (1F1B; ZB-H1, whose deferrable linear layers stay outside the graph so that W still
defers), the same ``pipewright train`` command runs with and without ``--compile`` (two CPU worker
processes, pp = 2, one thread each), alternating which goes first over ``--reps`` repetitions so that a
shared machine's load hits both alike. A run's step time is the median ``step_time_s`` of
``metrics.jsonl`` after the first ``--skip`` steps (compilation happens in the first steps and is left
out; it is reported separately as the first step's time). The result is the ratio compiled / eager of
the medians over repetitions (< 1: compiling is faster), and the final losses of both (equal within
rounding: the same run).

    PYTHONPATH=src python benchmarks/bench_compile.py [--schedules 1f1b,zb-h1] [--reps 2] [--steps 30]
        [--hidden 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_train(schedule: str, compiled: bool, args: argparse.Namespace, out: Path) -> dict:
    """One ``pipewright train`` run; its step times and losses from metrics.jsonl."""
    cmd = [
        sys.executable, "-m", "pipewright", "train", "--model", "gpt", "--layers", "4",
        "--hidden", str(args.hidden), "--heads", "4", "--seq-len", str(args.seq_len), "--pp", "2",
        "--schedule", schedule, "--microbatches", "4", "--microbatch-size", str(args.microbatch_size),
        "--steps", str(args.steps), "--warmup", "2", "--eval-every", "0", "--no-artifacts",
        "--no-progress", "--out", str(out),
    ] + (["--compile"] if compiled else [])  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    times = [r["step_time_s"] for r in records]
    return {
        "step_s": statistics.median(times[args.skip :]),
        "first_step_s": times[0],
        "loss": records[-1]["loss"],
        "wall_s": time.perf_counter() - t0,
        "eager_fallback": "runs eagerly" in done.stderr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-h1")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        for schedule in args.schedules.split(","):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for rep in range(args.reps):
                order = (False, True) if rep % 2 == 0 else (True, False)
                for compiled in order:
                    out = Path(tmp) / f"{schedule}-{compiled}-{rep}"
                    runs[compiled].append(run_train(schedule, compiled, args, out))
            eager = statistics.median(r["step_s"] for r in runs[False])
            comp = statistics.median(r["step_s"] for r in runs[True])
            results[schedule] = {
                "eager_step_s": eager,
                "compiled_step_s": comp,
                "ratio_compiled_over_eager": comp / eager,
                "compiled_first_step_s": statistics.median(r["first_step_s"] for r in runs[True]),
                "eager_first_step_s": statistics.median(r["first_step_s"] for r in runs[False]),
                "loss_eager": runs[False][0]["loss"],
                "loss_compiled": runs[True][0]["loss"],
                "eager_fallback": any(r["eager_fallback"] for r in runs[True]),
            }
            r = results[schedule]
            print(
                f"{schedule:>6}: eager {eager * 1e3:8.1f} ms/step, compiled {comp * 1e3:8.1f} ms/step, "
                f"ratio {r['ratio_compiled_over_eager']:.2f}; first step {r['compiled_first_step_s']:.1f} s "
                f"compiled vs {r['eager_first_step_s']:.2f} s; final loss {r['loss_eager']:.5f} / "
                f"{r['loss_compiled']:.5f}",
                flush=True,
            )
    meta = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "args": vars(args),
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
