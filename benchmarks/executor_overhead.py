"""Per-action overhead of the pipeline executor on gloo: 1F1B, tiny tensors, 2 ranks (or 1: no p2p).

With 4-wide linear stages the compute is negligible, so time per action ≈ the executor's own cost
(handler dispatch, autograd calls, p2p posting and waiting). Also times the bare compute (the same
forwards/backwards without the executor, one process) for comparison.

    PYTHONPATH=src python benchmarks/executor_overhead.py [--microbatches 8] [--iterations 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pipewright.runtime import ParallelMesh, PipelineExecutor, spawn
from pipewright.schedules import build_schedule

WIDTH, MB = 4, 2


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _worker(rank: int, ranks: int, schedule_name: str, m: int, iterations: int, record: bool) -> dict:
    mesh = ParallelMesh.build(1, ranks, 1)
    torch.manual_seed(0)
    stages = [nn.Linear(WIDTH, WIDTH) for _ in range(ranks)]
    sched = build_schedule(schedule_name, ranks, m)
    ex = PipelineExecutor(
        sched, mesh, {rank: stages[rank]}, loss_fn=_loss, boundary_shape=(MB, WIDTH), record=record
    )
    xs = [torch.randn(MB, WIDTH) for _ in range(m)]
    ys = [torch.randn(MB, WIDTH) for _ in range(m)]
    for _ in range(5):
        ex.run(xs, ys)
    start = time.perf_counter()
    for _ in range(iterations):
        ex.run(xs, ys)
    elapsed = (time.perf_counter() - start) / iterations
    # The same compute without the executor: m forwards and backwards of one stage.
    start = time.perf_counter()
    for _ in range(iterations):
        for k in range(m):
            _loss(stages[rank](xs[k]), ys[k]).backward()
    bare = (time.perf_counter() - start) / iterations
    return {"iteration_s": elapsed, "actions": len(ex.actions), "bare_s": bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (1: no communication)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--record", action="store_true", help="also record spans (timeline)")
    args = parser.parse_args()
    results = spawn(
        _worker,
        args.ranks,
        (args.ranks, args.schedule, args.microbatches, args.iterations, args.record),
        backend="gloo",
    )
    for rank, r in enumerate(results):
        per_action = r["iteration_s"] / r["actions"]
        print(
            f"rank {rank}: {r['iteration_s'] * 1e3:.2f} ms/iteration, {r['actions']} actions, "
            f"{per_action * 1e6:.0f} µs/action; bare compute {r['bare_s'] * 1e3:.2f} ms/iteration"
        )


if __name__ == "__main__":
    main()
