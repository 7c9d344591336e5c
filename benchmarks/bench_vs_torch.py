"""pipewright's PipelineExecutor against torch.distributed.pipelining: step time, side by side in one run.

Two gloo workers (one CPU thread each) are spawned once. In them, for every (model size, schedule),
both runtimes get the same GPT stages (models/gpt.py, same seed, so same weights), the same batch and
the same loss, and run the same schedule; their training steps (forward + backward of the whole
pipeline over m microbatches, gradients zeroed outside the timed region) alternate, pipewright first
on even repetitions and PyTorch first on odd ones, so that the load of a shared machine hits both alike.
A step's time is the slower rank's, measured from a barrier: wall time, and CPU time of the worker
process (``time.process_time``: its threads, gloo's included), which the machine's load disturbs less.

Schedules (p = 2) and PyTorch's twin: ``1f1b`` / ``Schedule1F1B``; ``interleaved-1f1b`` (v = 2) /
``ScheduleInterleaved1F1B``; ``zb-h1`` / ``ScheduleInterleavedZeroBubble`` with one stage per rank;
``zbv-torch`` (v = 2, V placement) / ``ScheduleZBVZeroBubble``. For the multi-stage ones the benchmark checks
that PyTorch's compute order equals ours. Modules: pipewright's stages are built as ``pipewright
train`` builds them (``models.wgrad.linear_factory_for``): ``nn.Linear`` for 1F1B and interleaved
1F1B, ``DeferrableLinear`` for the zero-bubble schedules (the I/W split, with weight gradients
accumulated into ``.grad`` fused into one GEMM); PyTorch gets ``nn.Linear`` throughout (it splits the
autograd graph for its zero-bubble schedules), with the same weights.

Sanity (first step): PyTorch's per-microbatch losses equal pipewright's, and so do the gradients.

    PYTHONPATH=src python benchmarks/bench_vs_torch.py [--sizes tiny,compute] [--reps 30,7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipewright.models.gpt import build_stage, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import linear_factory_for, plain_linear_factory
from pipewright.runtime import ParallelMesh, PipelineExecutor, spawn
from pipewright.schedules import build_schedule


@dataclass(frozen=True)
class Size:
    spec: ModelSpec
    microbatch: int
    microbatches: int


#: tiny: overhead-bound; compute: a layer's forward takes tens of ms on one CPU thread.
SIZES = {
    "tiny": Size(ModelSpec("tiny", layers=4, hidden=32, heads=2, vocab=64, seq_len=16), 2, 8),
    "compute": Size(ModelSpec("compute", layers=4, hidden=512, heads=8, vocab=512, seq_len=128), 4, 4),
}

#: our schedule name → (chunks per rank v, PyTorch's class)
SCHEDULES = {
    "1f1b": (1, "Schedule1F1B"),
    "interleaved-1f1b": (2, "ScheduleInterleaved1F1B"),
    "zb-h1": (1, "ScheduleInterleavedZeroBubble"),
    "zbv-torch": (2, "ScheduleZBVZeroBubble"),
}
P = 2


class _Pair:
    """One schedule on this rank, set up for both runtimes."""

    def __init__(self, name: str, size: Size, mesh: ParallelMesh) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        v, cls_name = SCHEDULES[name]
        spec, mb, m = size.spec, size.microbatch, size.microbatches
        self.sched = build_schedule(name, P, m, v)
        n = self.sched.num_stages
        mine = list(self.sched.stages_of(mesh.pp_rank))

        def stages(factory) -> dict[int, nn.Module]:
            return {s: build_stage(spec, None, s, num_stages=n, linear_factory=factory) for s in mine}

        # pipewright's layers as `pipewright train` builds them (wgrad.linear_factory_for: DeferrableLinear
        # where the schedule splits the backward, else nn.Linear); PyTorch: nn.Linear, the same weights
        self.ours = stages(linear_factory_for(self.sched))
        self.theirs = stages(plain_linear_factory)
        self.ex = PipelineExecutor(
            self.sched, mesh, self.ours, loss_fn=loss_fn, boundary_shape=(mb, spec.seq_len, spec.hidden)
        )
        device = torch.device("cpu")
        stages = [PipelineStage(self.theirs[s], s, n, device) for s in mine]
        cls = getattr(schedules, cls_name)
        self.torch = cls(stages[0] if v == 1 and cls_name == "Schedule1F1B" else stages, m, loss_fn=loss_fn)
        order = getattr(self.torch, "pipeline_order", None)
        self.same_order = None
        if order is not None:
            theirs = [str(a) for a in order[mesh.pp_rank] if a is not None and "REDUCE" not in str(a)]
            self.same_order = theirs == [str(a) for a in self.sched.actions[mesh.pp_rank]]
        self.first, self.last = 0 in mine, n - 1 in mine
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randint(spec.vocab, (m * mb, spec.seq_len), generator=gen)
        self.y = torch.randint(spec.vocab, (m * mb, spec.seq_len), generator=gen)
        self.m = m

    def _zero(self) -> None:
        for mod in (*self.ours.values(), *self.theirs.values()):
            mod.zero_grad(set_to_none=True)

    def step_ours(self) -> tuple[float, float, list[float]]:
        self._zero()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses = self.ex.run(
            list(self.x.chunk(self.m)) if self.first else None,
            list(self.y.chunk(self.m)) if self.last else None,
        )
        return time.perf_counter() - t0, time.process_time() - c0, losses

    def step_torch(self) -> tuple[float, float, list[float]]:
        self._zero()
        losses: list[torch.Tensor] = []
        args = (self.x,) if self.first else ()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        self.torch.step(*args, target=self.y if self.last else None, losses=losses, return_outputs=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        return elapsed, cpu, [float(t.detach()) for t in losses]

    def grads(self, modules: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
        return {
            f"{s}.{k}": p.grad.clone()
            for s, mod in modules.items()
            for k, p in mod.named_parameters()
            if p.grad is not None
        }


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sanity(pair: _Pair) -> dict:
    """One step of each: same per-microbatch losses and gradients (max relative difference)."""
    *_, ours = pair.step_ours()
    g_ours = pair.grads(pair.ours)
    *_, theirs = pair.step_torch()
    g_theirs = pair.grads(pair.theirs)
    diff = 0.0
    for k, g in g_ours.items():
        diff = max(diff, float((g - g_theirs[k]).abs().max() / g.abs().max().clamp_min(1e-30)))
    if set(g_ours) != set(g_theirs):
        diff = float("inf")
    loss_diff = max((abs(a - b) for a, b in zip(ours, theirs, strict=True)), default=0.0)
    # both ranks agree on the verdict (the loss lives on the last stage's rank only)
    t = torch.tensor([diff, loss_diff, float(len(ours) != len(theirs))], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {
        "grad_rel_diff": float(t[0]),
        "loss_abs_diff": float(t[1]),
        "loss_count_mismatch": bool(t[2]),
        "losses": ours,
    }


def worker(rank: int, sizes: list[str], schedules: list[str], reps: list[int], warmup: int) -> list[dict]:
    mesh = ParallelMesh.build(1, P, 1)
    results = []
    for size_name, n_reps in zip(sizes, reps, strict=True):
        pairs = {name: _Pair(name, SIZES[size_name], mesh) for name in schedules}
        sanity = {name: _sanity(pair) for name, pair in pairs.items()}
        times = {name: ([], [], [], []) for name in schedules}  # wall ours, torch; CPU ours, torch
        for rep in range(warmup + n_reps):
            for name, pair in pairs.items():
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for which in order:
                    wall, cpu = _slowest(*(pair.step_ours if which == 0 else pair.step_torch)()[:2])
                    if rep >= warmup:
                        times[name][which].append(wall)
                        times[name][2 + which].append(cpu)
        for name, pair in pairs.items():
            results.append(
                {
                    "size": size_name,
                    "schedule": name,
                    "torch_class": SCHEDULES[name][1],
                    "same_order": pair.same_order,
                    "pipewright_s": times[name][0],
                    "torch_s": times[name][1],
                    "pipewright_cpu_s": times[name][2],
                    "torch_cpu_s": times[name][3],
                    **sanity[name],
                }
            )
    return results


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def summarise(result: dict) -> dict:
    """Wall-time quartiles of each runtime; the ratio pipewright/PyTorch of the medians, of the minima
    (load only ever adds time) and of the median CPU seconds per step; the IQR of the paired ratios."""
    ours, theirs = result["pipewright_s"], result["torch_s"]
    paired = [a / b for a, b in zip(ours, theirs, strict=True)]
    cpu_ours, cpu_theirs = result["pipewright_cpu_s"], result["torch_cpu_s"]
    return {
        "pipewright": _quartiles(ours),
        "torch": _quartiles(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "min_ratio": min(ours) / min(theirs),
        "cpu_ratio": statistics.median(cpu_ours) / statistics.median(cpu_theirs),
        "paired_ratio": _quartiles(paired),
    }


def run(
    sizes: list[str], schedules: list[str], reps: list[int], warmup: int = 2, timeout_s: float = 1800.0
) -> list[dict]:
    """Spawn the two workers once and return rank 0's results (the step times are the slower rank's)."""
    return spawn(worker, P, (sizes, schedules, reps, warmup), backend="gloo", timeout_s=timeout_s)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,compute")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--reps", default="40,7", help="timed repetitions per size (comma-separated)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the raw step times here")
    args = parser.parse_args()
    sizes, schedules = args.sizes.split(","), args.schedules.split(",")
    reps = [int(r) for r in args.reps.split(",")][: len(sizes)]
    results = run(sizes, schedules, reps, args.warmup)
    print(f"# {platform.machine()}, {platform.python_version()}, torch {torch.__version__}, gloo, p = {P}")
    for name in sizes:
        s = SIZES[name]
        print(
            f"# {name}: h={s.spec.hidden} layers={s.spec.layers} heads={s.spec.heads} V={s.spec.vocab} "
            f"seq={s.spec.seq_len} microbatch={s.microbatch} m={s.microbatches}"
        )
    print(
        "| size | schedule | PyTorch class | same order | pipewright ms (IQR) | PyTorch ms (IQR) "
        "| ratio of medians | paired ratio IQR | ratio of minima | CPU-time ratio "
        "| loss diff | grad rel diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = summarise(r)
        ours, theirs = s["pipewright"], s["torch"]
        print(
            f"| {r['size']} | {r['schedule']} | {r['torch_class']} | {r['same_order']} "
            f"| {ours[1] * 1e3:.2f} ({ours[0] * 1e3:.2f}–{ours[2] * 1e3:.2f}) "
            f"| {theirs[1] * 1e3:.2f} ({theirs[0] * 1e3:.2f}–{theirs[2] * 1e3:.2f}) "
            f"| {s['ratio']:.2f} | {s['paired_ratio'][0]:.2f}–{s['paired_ratio'][2]:.2f} "
            f"| {s['min_ratio']:.2f} | {s['cpu_ratio']:.2f} "
            f"| {r['loss_abs_diff']:.1e} | {r['grad_rel_diff']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
