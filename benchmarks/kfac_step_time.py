"""Step time with K-FAC in the bubbles vs the same schedule with AdamW, side by side.

One 2-process gloo spawn builds both trainers (default small model gpt-small-cpu, stdlib corpus,
pp = 2, 1F1B, m = 4) and alternates their steps (AdamW step k, K-FAC step k, …), so both see the same
machine load; reports the median step times, the ratio of medians, the paired ratios' quartiles, and
how many refreshes K-FAC completed (its refresh interval in steps).

    PYTHONPATH=src python benchmarks/kfac_step_time.py [--steps 30] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import spawn
from pipewright.training import prepare


def _worker(rank: int, runs, steps: int, fill_scale: float) -> dict | None:
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, pp=2, tp=1)
    trainers = [Trainer(run, mesh=mesh) for run in runs]
    trainers[1].optimizer.worker.fill_scale = fill_scale
    times: list[list[float]] = [[], []]
    for step in range(steps):
        for j, tr in enumerate(trainers):
            dist.barrier()
            t0 = time.perf_counter()
            tr.forward_backward(step)
            tr.optimizer_step(step)
            dist.barrier()
            times[j].append(time.perf_counter() - t0)
    worker = trainers[1].optimizer.worker
    return {"times": times, "refreshes": worker.refreshes, "tasks": worker.tasks_run} if rank == 1 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--fill-scale", type=float, default=1.0, help="fraction of each predicted bubble used")
    args = ap.parse_args()
    base = TrainConfig(
        steps=args.steps, progress=False, artifacts=False, eval_every=0, schedule=args.schedule
    )
    runs = [prepare(base, world_size=2), prepare(replace(base, optimizer="kfac"), world_size=2)]
    res = spawn(_worker, 2, (runs, args.steps, args.fill_scale), backend="gloo", timeout_s=1800)[1]
    plain, kfac = (t[3:] for t in res["times"])  # first steps: warm-up, no measured F yet
    ratios = sorted(k / p for p, k in zip(plain, kfac, strict=True))
    q = statistics.quantiles(ratios, n=4)
    out = {
        "schedule": args.schedule,
        "fill_scale": args.fill_scale,
        "steps": args.steps,
        "median_plain_s": statistics.median(plain),
        "median_kfac_s": statistics.median(kfac),
        "ratio_of_medians": statistics.median(kfac) / statistics.median(plain),
        "paired_ratio_quartiles": [q[0], q[1], q[2]],
        "kfac_refreshes": res["refreshes"],
        "kfac_tasks_run_on_rank1": res["tasks"],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
