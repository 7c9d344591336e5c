"""DualPipeV (or ``--schedule 1f1b-overlap``, 1F1B with its steady-state F(k + w) and B(k) paired) with
the experts' all-to-alls overlapped against the same schedule with them blocking, at pp = 2 × dp = 2
with ep = 2 carved from dp (four gloo processes on this CPU), and the simulator's predicted ratios for
the same two runs.

The model: GPT, 4 layers, hidden 64, 4 heads, sequence 256, 8 experts of hidden 64 (top-2, dropless)
in every layer; 2 sequences per microbatch (512 tokens, 1,024 routed rows each way per all-to-all),
8 microbatches per replica, DualPipeV (v = 2) or 1F1B-overlap (v = 1). Small experts and many tokens
per microbatch make the all-to-all a visible share of the step.

Measured: one mesh, two trainers on it (``--blocking-pairs`` off and on), the same model and data;
rounds alternate the two (``--steps`` steps each, the first of each discarded), median step time
each; ratio = overlapped / blocking. In the overlapped run each F&B pair's forward runs on a second
thread, its all-to-alls over the ep group, while the other microbatch's backward computes and runs
its all-to-alls over a second group of the same ranks (``runtime/parallel/moe_parallel.py``,
``runtime/parallel/cp/overlap.py``).
Start-up (process group, mesh, both trainers) is reported apart and not in the step times.

Predicted, two ways:

- from this run (``sim/pair_overlap.py``, as ``bench_dualpipe_overlap.py`` does for cp): the blocking
  trainer's last step as the cost model — the median span of every (stage, kind) on each pipeline
  rank of dp rank 0 — and the time its all-to-alls took per forward / backward action
  (``GroupExchange.waited``); each F&B pair then costs max(c_F + c_B, x_F + x_B) instead of the sum.
- from the cost model alone (``pipewright simulate`` with ``--gpu cpu --ep 2`` and the MoE shape,
  ``cost/moe_cost.py``): the ``cpu`` accelerator preset (one single-threaded process = 90 GFLOP/s
  fp32, gloo loopback as the link; no calibration file), the four processes sharing ``--cores``
  cores (default: this machine's), overlapped as ``simulate`` prices the schedule's pairs and
  blocking with the same cost model with the pairs' overlap off.

    PYTHONPATH=src python benchmarks/bench_moe_overlap.py [--rounds 3] [--steps 4] [--schedule 1f1b-overlap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from bench_dualpipe_overlap import alternate, blocking_costs, predicted_ratio, run_both

from pipewright.models.moe_mlp import moe_layers
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import info

MODEL = {
    "model": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 256,
    "ffn_hidden": 256, "moe_experts": 8, "moe_top_k": 2, "moe_ffn_hidden": 64,
}  # fmt: skip
LAYOUT = {"pp": 2, "dp": 2, "ep": 2, "microbatch_size": 2, "microbatches": 8}


def _config(data: str, schedule: str = "dualpipev") -> TrainConfig:
    return TrainConfig(
        **MODEL, **LAYOUT, schedule=schedule, virtual=info(schedule).default_chunks, steps=1000, lr=1e-3,
        warmup=1, data=data, progress=False, artifacts=False, eval_every=0, recv_timeout_s=300,
    )  # fmt: skip


def _exchange(trainer: Trainer):
    """The trainer's :class:`~pipewright.runtime.parallel.moe_parallel.GroupExchange` (one, shared by its
    MoE layers)."""
    return next(layer.exchange for stage in trainer.stages.values() for layer in moe_layers(stage))


def _worker(rank: int, runs: list[PreparedRun], rounds: int, steps: int) -> dict | None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    c = runs[0].config
    mesh = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp, ep=c.ep)
    trainers = [Trainer(run, mesh=mesh) for run in runs]  # [overlapped, blocking]
    startup = time.perf_counter() - start
    times = alternate(trainers, rounds, steps, _exchange)
    spans, exposed = blocking_costs(trainers[1], _exchange(trainers[1]).waited)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((mesh.dp_rank, spans, exposed), gathered, dst=0)
    if rank != 0:
        return None
    pairs = trainers[0].moe.pair_overlap
    return {
        "times": times,
        "ranks": gathered,
        "pairs": pairs.pairs_overlapped if pairs is not None else 0,
        "startup_s": startup,
    }


def simulated_ratio(cores: float, name: str = "dualpipev") -> tuple[float, float, float]:
    """(overlapped, blocking, ratio) of ``pipewright simulate`` for the benchmark's configuration on
    the ``cpu`` preset, the processes sharing ``cores`` cores (module docstring)."""
    from pipewright.mesh import Mesh
    from pipewright.models.presets import resolve_model
    from pipewright.plan.setup import cluster_topology, core_sharing, model_setup
    from pipewright.schedules import build_schedule

    spec = resolve_model(MODEL["model"], **{k: v for k, v in MODEL.items() if k != "model"})
    p, d, ep = LAYOUT["pp"], LAYOUT["dp"], LAYOUT["ep"]
    topo, gpu = cluster_topology("cpu", 1, p * d)
    schedule = build_schedule(name, p, LAYOUT["microbatches"], info(name).default_chunks)
    setup = model_setup(
        spec, topo, Mesh(1, p, d, ep=ep), schedule, LAYOUT["microbatch_size"], gpu=gpu, dtype="fp32"
    )
    setup = replace(setup, shared=core_sharing(p, cores, {}, processes_per_rank=d))
    over = setup.simulate().makespan
    block = replace(setup, cost=replace(setup.cost, overlap=False)).simulate().makespan
    return over, block, over / block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    ap.add_argument("--schedule", default="dualpipev", choices=("dualpipev", "1f1b-overlap"))
    args = ap.parse_args()
    runs, result, wall = run_both(partial(_config, schedule=args.schedule), _worker, args.rounds, args.steps)
    over, block = (statistics.median(result["times"][i]) for i in (0, 1))
    r_over, r_block, r_ratio = predicted_ratio(runs[0].schedule, result["ranks"])
    s_over, s_block, s_ratio = simulated_ratio(args.cores, args.schedule)
    m = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    print(f"{args.schedule} pp=2 dp=2 ep=2 b={LAYOUT['microbatch_size']} m={LAYOUT['microbatches']}; {m}")
    print(f"  {wall:.0f} s wall, start-up {result['startup_s']:.1f} s (process group, mesh, 2 trainers)")
    print(f"  pairs overlapped per step (rank 0): {result['pairs'] // (args.rounds * args.steps)}")
    print(
        f"  measured step: overlapped {over * 1e3:.1f} ms, blocking {block * 1e3:.1f} ms, "
        f"ratio {over / block:.3f}"
    )
    print(
        f"  predicted from the blocking run's spans: overlapped {r_over * 1e3:.1f} ms, "
        f"blocking {r_block * 1e3:.1f} ms, ratio {r_ratio:.3f}"
    )
    print(
        f"  simulate --gpu cpu --cores {args.cores:g}: overlapped {s_over * 1e3:.1f} ms, "
        f"blocking {s_block * 1e3:.1f} ms, ratio {s_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
