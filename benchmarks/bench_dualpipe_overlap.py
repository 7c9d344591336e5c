"""DualPipeV with its F&B pairs overlapped against the same schedule with the pairs one after the other,
under context parallelism (pp = 2 × cp = 2, four gloo processes on this CPU), and the simulator's
predicted ratio for the same two runs.

Measured: one mesh, two trainers on it (``--blocking-pairs`` off and on), the same model and data;
rounds alternate the two (``--steps`` steps each, the first of each discarded), median step time
each; ratio = overlapped / blocking. In the overlapped run the forward of each pair runs on a second
thread (its ring exchanges on its own group) while the backward computes (``runtime/parallel/cp/overlap.py``).

Predicted (``sim/pair_overlap.py``): the blocking run's own measurements as the cost model: the
median span of every (stage, kind) of the blocking trainer's last step, on every pipeline rank, and
the ring's exposed wait per forward / backward action (``DistRing.waited``, per step, divided by the
rank's forwards / backwards); the simulator then prices every F&B pair as max(c_F + c_B, x_F + x_B)
instead of the sum. Communication between pipeline ranks is left free (it is asynchronous in both).

    PYTHONPATH=src python benchmarks/bench_dualpipe_overlap.py [--rounds 3] [--steps 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipewright.data.tokens import write_tokens
from pipewright.ir import Action, B, F, I, Schedule
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import spawn
from pipewright.sim.engine import simulate
from pipewright.sim.pair_overlap import PairOverlapCost
from pipewright.training import prepare

BACKWARD = (B, I)


def _config(data: str, seq_len: int, hidden: int) -> TrainConfig:
    return TrainConfig(
        model="gpt", layers=4, hidden=hidden, heads=4, vocab=256, seq_len=seq_len, microbatch_size=1,
        microbatches=8, pp=2, cp=2, schedule="dualpipev", virtual=2, steps=1000, lr=1e-3, warmup=1,
        data=data, progress=False, artifacts=False, eval_every=0, recv_timeout_s=300,
    )  # fmt: skip


def alternate(
    trainers: list[Trainer], rounds: int, steps: int, waits: Callable[[Trainer], Any]
) -> dict[int, list[float]]:
    """Step times of ``trainers`` by index: ``rounds`` rounds of ``steps`` steps each, the first step
    of each round dropped; ``waits(trainer).waited`` is reset before every step."""
    times: dict[int, list[float]] = defaultdict(list)
    step = 0
    for _ in range(rounds):
        for i, trainer in enumerate(trainers):
            for j in range(steps):
                waits(trainer).waited = {False: 0.0, True: 0.0}
                record = trainer.train_step(step)
                step += 1
                if j > 0:
                    times[i].append(record["step_time_s"])
    return dict(times)


def blocking_costs(blocking: Trainer, waited: dict[bool, float]) -> tuple[list, tuple[float, float]]:
    """The blocking trainer's last step: its compute spans (action, seconds) and the communication
    waited per forward and per backward action (``waited``: seconds by backward or not)."""
    spans = [(s.action, s.duration) for s in blocking.executor.last_spans if s.stream == "compute"]
    n_f = sum(1 for a, _ in spans if a.kind == F)
    n_b = sum(1 for a, _ in spans if a.kind in BACKWARD)
    return spans, (waited[False] / max(n_f, 1), waited[True] / max(n_b, 1))


def _worker(rank: int, runs: list[PreparedRun], rounds: int, steps: int) -> dict | None:
    torch.set_num_threads(1)
    c = runs[0].config
    mesh = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp)
    trainers = [Trainer(run, mesh=mesh) for run in runs]  # [overlapped, blocking]
    times = alternate(trainers, rounds, steps, lambda t: t.context.ring)
    blocking = trainers[1]
    spans, exposed = blocking_costs(blocking, blocking.context.ring.waited)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((mesh.cp_rank, spans, exposed), gathered, dst=0)
    if rank != 0:
        return None
    return {
        "times": times,
        "ranks": gathered,
        "pairs": trainers[0].context.pair_overlap.pairs_overlapped,
    }


class _Measured:
    """Compute time per (stage, kind): the median measured span; 0 for anything else."""

    def __init__(self, table: dict[tuple[int, str], float]) -> None:
        self.table = table

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        return (
            self.table.get((action.stage, action.kind), 0.0) if schedule.kinds[action.kind].compute else 0.0
        )

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        return 0.0

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        return 0.0

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return 0.0

    def flops(self, action: Action, schedule: Schedule) -> float:
        return 0.0

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        return 0.0


def predicted_ratio(schedule: Schedule, ranks: list) -> tuple[float, float, float]:
    """(overlapped, blocking, ratio) simulated from the blocking run's spans and ring waits (cp rank 0)."""
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    exposed_f, exposed_b = [], []
    for cp_rank, spans, (x_f, x_b) in ranks:
        if cp_rank != 0:
            continue
        for a, d in spans:
            durations[(a.stage, a.kind)].append(d)
        exposed_f.append(x_f)
        exposed_b.append(x_b)
    table = {k: statistics.median(v) for k, v in durations.items()}
    x_f, x_b = statistics.mean(exposed_f), statistics.mean(exposed_b)

    def exposed(a: Action, _: Schedule) -> float:
        return x_f if a.kind == F else x_b if a.kind in BACKWARD else 0.0

    base = _Measured(table)
    over = simulate(schedule, PairOverlapCost(base, exposed, overlap=True)).makespan
    block = simulate(schedule, PairOverlapCost(base, exposed, overlap=False)).makespan
    return over, block, over / block


def run_both(
    config: Callable[[str], TrainConfig], worker: Callable, rounds: int, steps: int
) -> tuple[list[PreparedRun], dict, float]:
    """Prepare ``config(data)`` overlapped and with ``--blocking-pairs`` on a fresh token file, run
    ``worker(rank, runs, rounds, steps)`` in four processes: (the two runs, rank 0's result, wall s)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        write_tokens(data, np.random.default_rng(0).integers(0, 256, 200_000), vocab_size=256)
        base = config(str(data))
        runs = [
            prepare(replace(base, out=str(Path(tmp) / f"run{b}"), blocking_pairs=b)) for b in (False, True)
        ]
        t0 = time.perf_counter()
        result = spawn(worker, 4, (runs, rounds, steps), timeout_s=3600)[0]
        return runs, result, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    config = partial(_config, seq_len=args.seq_len, hidden=args.hidden)
    runs, result, wall = run_both(config, _worker, args.rounds, args.steps)
    over, block = (statistics.median(result["times"][i]) for i in (0, 1))
    s_over, s_block, s_ratio = predicted_ratio(runs[0].schedule, result["ranks"])
    print(f"dualpipev pp=2 cp=2, gpt 4 layers h={args.hidden} s={args.seq_len} m=8, {wall:.0f} s wall")
    print(f"  pairs overlapped per step (rank 0): {result['pairs'] // (args.rounds * args.steps)}")
    print(
        f"  measured step: overlapped {over * 1e3:.1f} ms, blocking {block * 1e3:.1f} ms, "
        f"ratio {over / block:.3f}"
    )
    print(
        f"  simulated: overlapped {s_over * 1e3:.1f} ms, blocking {s_block * 1e3:.1f} ms, ratio {s_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
