"""The planner's layout for Llama 3 405B on 16,384 H100s next to the one Meta published (the table in
docs/planner.md), both simulated through ``pipewright simulate``.

    PYTHONPATH=src python tools/plan_llama405b.py [--out DIR]

Model: llama3-405b (126 layers, h 16384, 128 heads, 8 kv heads, ffn 53248, vocabulary 128256, sequence
8192), global batch 2048 sequences, bf16, on 2,048 nodes × 8 H100 SXM. Meta's layout (Llama 3 paper,
§3.3.2): TP 8, CP 1, PP 16, DP 128, interleaved 1F1B, microbatch 1 — simulated here with v = 4 chunks and
the lightest recomputation that fits (the paper gives neither). Prints the planning time (CPU and wall
seconds of ``pipewright plan``, one process), both ``simulate`` commands and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ["--gpu", "h100-sxm", "--nodes", "2048", "--gpus-per-node", "8"]
MODEL = ["--model", "llama3-405b", "--global-batch-size", "2048"]
META = ["--tp", "8", "--pp", "16", "--dp", "128", "--schedule", "interleaved-1f1b", "--virtual", "4"]
META += ["--microbatch-size", "1", "--sequence-parallel"]


def pipewright(*argv: str) -> tuple[str, float, float]:
    """(stdout, CPU seconds, wall seconds) of one ``python -m pipewright`` run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pipewright", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if out.returncode != 0:
        raise SystemExit(f"pipewright {' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout, cpu, wall


def simulate(argv: list[str]) -> dict:
    return json.loads(pipewright("simulate", *argv, "--json")[0])


def row(name: str, config: str, report: dict, command: str) -> str:
    fits = "yes" if report["memory"]["fits"] else "no"
    peak = report["memory"]["peak_bytes"] / 2**30
    return (
        f"| {name} | {config} | {report['iteration_time_s']:.3f} | {report['tflops_per_device']:.0f} | "
        f"{100 * report['mfu']:.1f} % | {peak:.1f} | {fits} | `{command}` |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for plan.json (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        plan_path = folder / "plan.json"
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        _, cpu, wall = pipewright("plan", *MODEL, *CLUSTER, "--no-progress", "-o", str(plan_path))
        plan = json.loads(plan_path.read_text())
        print(f"pipewright plan: {cpu:.1f} s CPU, {wall:.1f} s wall (load average before: {load})")
        plan_cmd = ["--plan", str(plan_path), *CLUSTER]
        ours = simulate(plan_cmd)
        meta_report, meta_cmd = None, []
        for recompute in ("none", "selective", "full"):
            meta_cmd = [*MODEL, *CLUSTER, *META, "--recompute", recompute]
            meta_report = simulate(meta_cmd)
            if meta_report["memory"]["fits"]:
                break
        assert meta_report is not None
        config = (
            f"t={plan['tp']} cp={plan.get('cp', 1)} p={plan['pp']} d={plan['dp']} "
            f"b={plan['microbatch_size']} "
            f"{plan['schedule']} v={plan['virtual']} recompute={plan['recompute']} "
            f"sharding={plan.get('optimizer_sharding', 'none')} attention={plan.get('attention', 'eager')}"
        )
        meta_config = f"t=8 cp=1 p=16 d=128 b=1 interleaved-1f1b v=4 recompute={meta_cmd[-1]}"
        print("| layout | configuration | iteration s | TFLOP/s per GPU | MFU | peak GiB | fits | command |")
        print("|---|---|---|---|---|---|---|---|")
        print(row("planner", config, ours, "pipewright simulate " + " ".join(plan_cmd)))
        print(row("Meta (published)", meta_config, meta_report, "pipewright simulate " + " ".join(meta_cmd)))


if __name__ == "__main__":
    main()
