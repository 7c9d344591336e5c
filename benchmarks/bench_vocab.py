"""Vocabulary parallelism on CPU: pipeline step time with the vocabulary split over the ranks, over the
naive placement (embedding on the first stage, output layer and loss on the last), and the cost of the
chunked output layer.

1. Pipeline step (p = 2, 1F1B, m = 8, gloo, one thread per rank): GPT with 2 layers, h = 64, 2 heads,
   sequence 64, microbatch 4 and V = 32768 — the output layer (2·b·s·h·V ≈ 1.07 GFLOP forward per
   microbatch) is ~20× a transformer layer, so it dominates the last stage. Cases ``naive``, ``alg1``,
   ``alg2`` alternate in each round (same process group, same data); the median step after warm-up is
   reported and the ratio vocabulary-parallel / naive.
2. Chunked S/T (one process): S + T of one shard for 2048 tokens, h = 256, V_p = 8192, whole vs in
   chunks of 256 tokens: time ratio and the peak size of the [tokens × V_p] softmax kept from S to T.
3. Balance, measured: per pipeline rank, the parameters it holds (exact), the CPU time of its main
   thread per step (``time.thread_time``) and the wall time of its compute passes: the recorded compute
   spans minus the time they spent blocked in vocabulary collectives (``VocabRuntime.waited_s``: F(0) on
   the embedding sum, VS on the X broadcast, the last stage's B on ∇X), for each case; the spread is
   max / min over the ranks.

    PYTHONPATH=src python benchmarks/bench_vocab.py [--rounds 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.runtime import VocabRuntime, VocabStage, vocab_group
from pipewright.models.gpt import build_stage, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.runtime.executor import PipelineExecutor
from pipewright.runtime.mesh import ParallelMesh
from pipewright.schedules.registry import build_schedule

SPEC = ModelSpec("bench-vocab", layers=2, hidden=64, heads=2, vocab=32768, seq_len=64)
B, M, P = 4, 8, 2
CASES = ("naive", "alg1", "alg2")


def _data():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, SPEC.vocab, (B, SPEC.seq_len), generator=g) for _ in range(M)]
    return ids, [torch.roll(x, -1, 1) for x in ids]


def _setup(case: str, mesh, group):
    base = build_schedule("1f1b", P, M)
    if case == "naive":
        stages = {s: build_stage(SPEC, None, s, num_stages=P) for s in base.stages_of(mesh.pp_rank)}
        ex = PipelineExecutor(
            base, mesh, stages, loss_fn=loss_fn, boundary_shape=(B, SPEC.seq_len, SPEC.hidden), record=True
        )
        return ex, None, list(p for m in stages.values() for p in m.parameters())
    sched = insert_vocab(base, case)
    stages = {s: VocabStage(build_stage(SPEC, None, s, num_stages=P)) for s in sched.stages_of(mesh.pp_rank)}
    rt = VocabRuntime(SPEC, group, algorithm=case, microbatch_shape=(B, SPEC.seq_len), last_rank=P - 1)
    ex = PipelineExecutor(
        sched,
        mesh,
        stages,
        loss_fn=None,
        boundary_shape=(B, SPEC.seq_len, SPEC.hidden),
        handlers=rt.handlers(),
        record=True,
    )
    return ex, rt, [*rt.parameters(), *(p for m in stages.values() for p in m.parameters())]


def _worker(rank: int, init_file: str, rounds: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=P, timeout=timedelta(seconds=300)
    )
    mesh = ParallelMesh.build(pp=P, device="cpu")
    group = vocab_group(mesh)
    setups = {case: _setup(case, mesh, group) for case in CASES}
    ids, targets = _data()
    times: dict[str, list[float]] = {case: [] for case in CASES}
    busy: dict[str, list[float]] = {case: [] for case in CASES}  # this rank's compute seconds per step
    cpu: dict[str, list[float]] = {case: [] for case in CASES}  # its main thread's CPU seconds per step
    for _ in range(rounds):
        for case in CASES:
            ex, rt, params = setups[case]
            for step in range(steps):
                for prm in params:
                    prm.grad = None
                dist.barrier()
                waited0 = rt.waited_s if rt is not None else 0.0
                t0, c0 = time.perf_counter(), time.thread_time()
                ex.run(ids, targets)
                if rt is not None:
                    rt.finish()
                c1 = time.thread_time()
                dist.barrier()
                if step >= steps // 3:
                    times[case].append(time.perf_counter() - t0)
                    spans = sum(sp.duration for sp in ex.last_spans if sp.stream == "compute")
                    busy[case].append(spans - (rt.waited_s - waited0 if rt is not None else 0.0))
                    cpu[case].append(c1 - c0)
    params = {case: sum(p.numel() for p in setups[case][2]) for case in CASES}
    queue.put((rank, times, busy, params, cpu))
    dist.destroy_process_group()


def pipeline(rounds: int, steps: int) -> tuple[dict[str, list[float]], list[tuple]]:
    """(rank 0's step times per case, every rank's (rank, times, compute-span seconds, parameter count,
    main-thread CPU seconds))."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, init, rounds, steps, queue)) for r in range(P)]
        for proc in procs:
            proc.start()
        ranks = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r[0])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    times, ranks = pipeline(args.rounds, args.steps)
    med = {case: statistics.median(v) for case, v in times.items()}
    print("| case | median step (ms) | IQR (ms) | ratio over naive |")
    print("|---|---:|---:|---:|")
    for case in CASES:
        q = statistics.quantiles(times[case], n=4)
        iqr = f"{1e3 * q[0]:.1f}–{1e3 * q[2]:.1f}"
        print(f"| {case} | {1e3 * med[case]:.1f} | {iqr} | {med[case] / med['naive']:.2f} |")
    whole, chunk_ms, big, small = chunked(args.rounds * 2)
    print(
        f"\nchunked S+T: whole {whole:.1f} ms, chunked {chunk_ms:.1f} ms (ratio {chunk_ms / whole:.2f}); "
        f"softmax kept from S to T: {big / 2**20:.0f} MiB whole, 0 chunked (peak transient "
        f"{small / 2**20:.0f} MiB per chunk)"
    )
    print(
        "\n| case | parameters per rank (M) | spread | main-thread CPU per step per rank (ms, mean) | spread "
        "| compute passes without their waits, per step per rank (ms, mean) | spread |"
    )
    print("|---|---|---:|---|---:|---|---:|")
    for case in CASES:
        cols = []
        for values in (
            [r[3][case] / 1e6 for r in ranks],
            [1e3 * statistics.fmean(r[4][case]) for r in ranks],
            [1e3 * statistics.fmean(r[2][case]) for r in ranks],
        ):
            cols += [
                " / ".join(f"{x:.3f}" if x < 100 else f"{x:.1f}" for x in values),
                f"{max(values) / min(values):.2f}",
            ]
        print(f"| {case} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
