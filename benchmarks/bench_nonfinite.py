"""Cost of the per-step non-finite check: training steps with and without it, side by side.

The check (:meth:`pipewright.runtime.reliability.guard.RunGuard.before_optimizer`) is what ``pipewright
train``
does between the backward and the optimizer step: one fused ``isfinite`` per stage over this rank's
gradients and one all-reduce of two flags (non-finite, preemption) over all ranks. One 2-process gloo
spawn builds two identical trainers (the default model of ``pipewright train``, pp = 2, 1F1B, m = 4) and
alternates their steps — step k with the check, step k without — so both see the same machine load.
Reports the median step times, the ratio of medians, the paired ratios' quartiles and the median time
of the check itself.

    PYTHONPATH=src python benchmarks/bench_nonfinite.py [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import spawn
from pipewright.training import prepare

WARMUP = 3  # first steps of each trainer: allocator and thread warm-up, not measured


def _worker(rank: int, run, steps: int) -> dict | None:
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(dp=1, pp=2, tp=1)
    trainers = [Trainer(run, mesh=mesh) for _ in range(2)]
    times: list[list[float]] = [[], []]
    checks: list[float] = []
    for step in range(steps):
        for j, tr in enumerate(trainers):  # 0: with the check, 1: without
            dist.barrier()
            t0 = time.perf_counter()
            loss = tr.forward_backward(step)
            if j == 0:
                c0 = time.perf_counter()
                assert tr.guard.before_optimizer(step, loss)
                checks.append(time.perf_counter() - c0)
            tr.optimizer_step(step)
            dist.barrier()
            times[j].append(time.perf_counter() - t0)
    for tr in trainers:
        tr.guard.close()
    return {"times": times, "checks": checks} if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="steps per trainer and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    run = prepare(TrainConfig(steps=args.steps, progress=False, artifacts=False, eval_every=0), world_size=2)
    rounds = []
    for _ in range(args.rounds):
        res = spawn(_worker, 2, (run, args.steps), backend="gloo", timeout_s=1800)[0]
        with_check, without = (t[WARMUP:] for t in res["times"])
        ratios = sorted(w / o for w, o in zip(with_check, without, strict=True))
        rounds.append(
            {
                "with_ms": 1e3 * statistics.median(with_check),
                "without_ms": 1e3 * statistics.median(without),
                "ratio_of_medians": statistics.median(with_check) / statistics.median(without),
                "paired_ratio_quartiles": statistics.quantiles(ratios, n=4),
                "check_ms": 1e3 * statistics.median(res["checks"][WARMUP:]),
            }
        )
    print(json.dumps({"model": run.spec.name, "load_average": os.getloadavg(), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
