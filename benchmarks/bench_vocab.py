"""Vocabulary parallelism on CPU: pipeline step time with the vocabulary split over the ranks, over the
naive placement (embedding on the first stage, output layer and loss on the last), and the cost of the
chunked output layer.

1. Pipeline step (p = 2 or ``--pp``, 1F1B, m = 8, gloo, one thread per rank): GPT with max(2, p)
   layers, h = 64, 2 heads, sequence 64, microbatch 4 and V = 32768 — the output layer (2·b·s·h·V ≈
   1.07 GFLOP forward per microbatch) is ~20× a transformer layer, so it dominates the last stage.
   Cases ``naive``, ``alg1``, ``alg2`` alternate in each round (same process group, same data); the
   median step after warm-up is reported and the ratio vocabulary-parallel / naive.
2. Chunked S/T (one process): S + T of one shard for 2048 tokens, h = 256, V_p = 8192, whole vs in
   chunks of 256 tokens: time ratio and the peak size of the [tokens × V_p] softmax kept from S to T.
3. Balance, measured, for each vocabulary size of ``--vocab`` (32k … 256k): per pipeline rank, the
   parameters it holds (exact), the CPU time its main thread spends in compute passes per step
   (``time.thread_time`` around every handler of a compute kind: F, B, the vocabulary passes; waits in
   gloo sleep and cost no CPU), the wall time of those passes minus the time they spent blocked in
   vocabulary collectives (``VocabRuntime.waited_s``) and the rank's peak resident memory; the spread
   is max / min over the ranks.

Every worker starts with ``--cpu-allocator`` (default ``retain``, as ``pipewright train``;
``runtime/setup/host_memory.py``): under glibc's default the large logits and softmax blocks are mapped and
faulted in afresh every microbatch, unevenly across the ranks, which made equal passes measure up to
1.6× apart.

    PYTHONPATH=src python benchmarks/bench_vocab.py [--rounds 5] [--steps 6] [--vocab 32768,262144]
        [--cpu-allocator retain|system] [--one-core] [--pp 4] [--skip-chunked]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.runtime import VocabRuntime, VocabStage, vocab_group
from pipewright.models.gpt import build_stage, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.runtime.core.executor import PipelineExecutor
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.host_memory import ALLOCATORS, use_cpu_allocator
from pipewright.schedules.registry import build_schedule

B, M, SEQ = 4, 8, 64
CASES = ("naive", "alg1", "alg2")


def _cpu_meter(ex: PipelineExecutor) -> list[float]:
    """A one-element list that accumulates the main thread's CPU seconds in ``ex``'s compute passes."""
    total = [0.0]
    compute = {kind for kind, info in ex.schedule.kinds.items() if info.compute}

    def wrapper(kind, handler):
        if kind not in compute:
            return handler

        def timed(state, a):
            c0 = time.thread_time()
            handler(state, a)
            total[0] += time.thread_time() - c0

        return timed

    ex.wrap_handlers(wrapper)
    return total


@dataclass(frozen=True)
class Setting:
    """One measured configuration: vocabulary size, pipeline ranks (one transformer layer each, at
    least two layers), the allocator policy and whether every rank shares one core."""

    vocab: int = 32768
    pp: int = 2
    allocator: str = "retain"
    one_core: bool = False

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(
            "bench-vocab", layers=max(2, self.pp), hidden=64, heads=2, vocab=self.vocab, seq_len=SEQ
        )


def _data(spec: ModelSpec):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, spec.vocab, (B, spec.seq_len), generator=g) for _ in range(M)]
    return ids, [torch.roll(x, -1, 1) for x in ids]


def _setup(case: str, mesh, group, spec: ModelSpec):
    p = mesh.pp
    base = build_schedule("1f1b", p, M)
    shape = (B, spec.seq_len, spec.hidden)
    if case == "naive":
        stages = {s: build_stage(spec, None, s, num_stages=p) for s in base.stages_of(mesh.pp_rank)}
        ex = PipelineExecutor(base, mesh, stages, loss_fn=loss_fn, boundary_shape=shape, record=True)
        return ex, None, list(prm for m in stages.values() for prm in m.parameters())
    sched = insert_vocab(base, case)
    stages = {s: VocabStage(build_stage(spec, None, s, num_stages=p)) for s in sched.stages_of(mesh.pp_rank)}
    rt = VocabRuntime(spec, group, algorithm=case, microbatch_shape=(B, spec.seq_len), last_rank=p - 1)
    ex = PipelineExecutor(
        sched, mesh, stages, loss_fn=None, boundary_shape=shape, handlers=rt.handlers(), record=True
    )
    return ex, rt, [*rt.parameters(), *(prm for m in stages.values() for prm in m.parameters())]


def _worker(rank: int, init_file: str, rounds: int, steps: int, setting: Setting, queue) -> None:
    use_cpu_allocator(setting.allocator)
    if setting.one_core:  # every rank on the same core: a core faster than another cannot tilt the balance
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=setting.pp,
        timeout=timedelta(seconds=900),
    )
    mesh = ParallelMesh.build(pp=setting.pp, device="cpu")
    group = vocab_group(mesh)
    setups = {case: _setup(case, mesh, group, setting.spec) for case in CASES}
    meters = {case: _cpu_meter(setups[case][0]) for case in CASES}
    ids, targets = _data(setting.spec)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    busy: dict[str, list[float]] = {case: [] for case in CASES}  # this rank's compute seconds per step
    cpu: dict[str, list[float]] = {case: [] for case in CASES}  # main-thread CPU in compute passes
    for _ in range(rounds):
        for case in CASES:
            ex, rt, params = setups[case]
            for step in range(steps):
                for prm in params:
                    prm.grad = None
                dist.barrier()
                waited0 = rt.waited_s if rt is not None else 0.0
                t0, c0 = time.perf_counter(), meters[case][0]
                ex.run(ids, targets)
                if rt is not None:
                    rt.finish()
                c1 = meters[case][0]
                dist.barrier()
                if step >= steps // 3:
                    times[case].append(time.perf_counter() - t0)
                    spans = sum(sp.duration for sp in ex.last_spans if sp.stream == "compute")
                    busy[case].append(spans - (rt.waited_s - waited0 if rt is not None else 0.0))
                    cpu[case].append(c1 - c0)
    params = {case: sum(prm.numel() for prm in setups[case][2]) for case in CASES}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((rank, times, busy, params, cpu, peak_mib))
    dist.destroy_process_group()


def pipeline(
    rounds: int, steps: int, setting: Setting = Setting()
) -> tuple[dict[str, list[float]], list[tuple]]:
    """(rank 0's step times per case, every rank's (rank, times, compute-span seconds, parameter count,
    main-thread CPU seconds in compute passes, peak resident MiB))."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, init, rounds, steps, setting, queue))
            for r in range(setting.pp)
        ]
        for proc in procs:
            proc.start()
        ranks = sorted((queue.get(timeout=7200) for _ in procs), key=lambda r: r[0])
        for proc in procs:
            proc.join(timeout=60)
    return ranks[0][1], ranks


def chunked(rounds: int) -> tuple[float, float, int, int]:
    """(median ms whole, median ms chunked, softmax bytes whole, softmax bytes chunked) for S + T."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    n, h, rows, chunk = 2048, 256, 8192, 256
    x = torch.randn(n, h, generator=g)
    w = torch.randn(rows, h, generator=g) * 0.02
    labels = torch.randint(0, rows, (n,), generator=g)
    dloss = torch.full((n,), 1.0 / n)
    out: dict[str, list[float]] = {"whole": [], "chunked": []}
    for _ in range(rounds):
        for mode in out:
            t0 = time.perf_counter()
            if mode == "whole":
                s = vs.s_pass(x, w, labels, 0, rows, fused=False)
            else:
                s = vs.s_pass_chunked(x, w, labels, 0, rows, fused=False, chunk=chunk)
            merged = s.stats  # one shard: its statistics are the merged ones
            vs.t_pass(x, w, labels, 0, rows, s, merged, dloss, input_grad=True, chunk=chunk)
            out[mode].append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out["whole"]), statistics.median(out["chunked"]), 4 * n * rows, 4 * chunk * rows


def _per_rank(values: list[float]) -> tuple[str, str]:
    """("a / b / …", "max/min") for one metric over the ranks."""
    text = " / ".join(f"{x:.3f}" if x < 10 else f"{x:.1f}" for x in values)
    return text, f"{max(values) / min(values):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--vocab", default="32768", help="comma-separated vocabulary sizes, e.g. 32768,262144")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes; one layer each)")
    ap.add_argument("--cpu-allocator", choices=ALLOCATORS, default="retain")
    ap.add_argument(
        "--one-core",
        action="store_true",
        help="pin every rank to one core: the balance without core-to-core speed differences "
        "(step times then add up the ranks' work)",
    )
    ap.add_argument("--skip-chunked", action="store_true", help="leave out the chunked S/T measurement")
    args = ap.parse_args()
    use_cpu_allocator(args.cpu_allocator)
    where = "all ranks on one core" if args.one_core else "one core each"
    print(f"cpu allocator: {args.cpu_allocator}; {where}; p = {args.pp}, m = {M}, microbatch {B}×{SEQ}\n")
    print(
        "| V | case | median step (ms) | IQR (ms) | over naive | parameters per rank (M) | spread "
        "| compute-pass CPU per step per rank (ms) | spread | compute passes without waits (ms) | spread "
        "| peak RSS per rank, all cases (MiB) |"
    )
    print("|---:|---|---:|---:|---:|---|---:|---|---:|---|---:|---|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        setting = Setting(vocab, args.pp, args.cpu_allocator, args.one_core)
        times, ranks = pipeline(args.rounds, args.steps, setting)
        med = {case: statistics.median(v) for case, v in times.items()}
        for case in CASES:
            q = statistics.quantiles(times[case], n=4)
            cols = [
                f"{vocab // 1024}k",
                case,
                f"{1e3 * med[case]:.1f}",
                f"{1e3 * q[0]:.1f}–{1e3 * q[2]:.1f}",
                f"{med[case] / med['naive']:.2f}",
            ]
            cols += _per_rank([r[3][case] / 1e6 for r in ranks])
            cols += _per_rank([1e3 * statistics.fmean(r[4][case]) for r in ranks])
            cols += _per_rank([1e3 * statistics.fmean(r[2][case]) for r in ranks])
            cols.append(" / ".join(f"{r[5]:.0f}" for r in ranks))
            print("| " + " | ".join(cols) + " |", flush=True)
    if args.skip_chunked:
        return
    whole, chunk_ms, big, small = chunked(args.rounds * 2)
    print(
        f"\nchunked S+T: whole {whole:.1f} ms, chunked {chunk_ms:.1f} ms (ratio {chunk_ms / whole:.2f}); "
        f"softmax kept from S to T: {big / 2**20:.0f} MiB whole, 0 chunked (peak transient "
        f"{small / 2**20:.0f} MiB per chunk)"
    )


if __name__ == "__main__":
    main()
