"""Peak activation memory per pipeline rank under none / selective / full recomputation, and optimizer
state per rank with and without ZeRO-1 — measured on CPU processes and set beside the cost model.

Measuring on CPU: glibc serves every allocation of 64 KiB or more with its own mmap when
``MALLOC_MMAP_THRESHOLD_=65536`` (set before the workers start; a fixed threshold also turns off glibc's
dynamic threshold), so the resident set rises and falls with the live tensors. Per rank: one warm-up
step, then the kernel's high-water mark is reset (``/proc/self/clear_refs`` ← 5) and one more
forward/backward iteration runs; peak activation memory = VmHWM − VmRSS before the iteration. It
includes what the backward allocates on top of the activations (gradients, temporaries) — the cost
model's activation terms do not.

Prediction: :func:`pipewright.cost.activations.runtime_stage_peak_bytes` (pipewright's own tensors)
and Korthikanti et al.'s per-layer formula (:func:`korthikanti_layer_bytes`, what the analytical cost
model uses), for the microbatches a 1F1B rank holds at once (pp − r).

Usage: ``python benchmarks/bench_recompute_memory.py [--json out.json]`` (≈ 1 min on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import numpy as np
import torch
import torch.distributed as dist

from pipewright.cost.activations import korthikanti_layer_bytes, runtime_stage_peak_bytes
from pipewright.data.tokens import write_tokens
from pipewright.runtime.core.trainer import Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.launch import spawn
from pipewright.training import prepare

MIB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _activation_peak(trainer: Trainer) -> int:
    trainer.forward_backward(0)
    trainer.optimizer_step(0)
    for mod in trainer.stages.values():
        mod.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    trainer.forward_backward(1)
    return _status("VmHWM") - base


def _optimizer_bytes(trainer: Trainer) -> int:
    opt = trainer.optimizer
    total = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.ndim > 0)
    if trainer.master is not None and trainer.master.separate_masters:
        total += sum(m.numel() * m.element_size() for m in trainer.master.masters.values())
    return total


def _worker(rank: int, runs: list) -> list:
    torch.set_num_threads(1)
    meshes: dict = {}
    out = []
    for kind, run in runs:
        c = run.config
        key = (c.dp, c.pp, c.tp)
        if key not in meshes:
            meshes[key] = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp)
        trainer = Trainer(run, mesh=meshes[key])
        if kind == "memory":
            value = _activation_peak(trainer)
        else:
            trainer.forward_backward(0)
            trainer.optimizer_step(0)
            value = _optimizer_bytes(trainer)
        params = sum(p.numel() for p in trainer.params.values())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (value, params, trainer.mesh.pp_rank))
        out.append(gathered)
        del trainer
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--only", choices=("memory", "optimizer"), help="run one of the two tables")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="pw-mem-"))
    data = root / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 200_000), vocab_size=256)
    base = TrainConfig(
        model="gpt", layers=4, hidden=64, heads=4, vocab=256, seq_len=args.seq_len, pp=2, microbatches=4,
        microbatch_size=args.microbatch_size, steps=2, data=str(data), progress=False, artifacts=False,
        eval_every=0, schedule="1f1b",
    )  # fmt: skip
    memory_cases = [
        (mode, precision, replace(base, recompute=mode, precision=precision))
        for precision in ("fp32", "bf16")
        for mode in ("none", "selective", "full")
    ]
    opt_base = TrainConfig(
        pp=2, dp=2, microbatches=2, microbatch_size=1, steps=2, data=str(data), progress=False,
        artifacts=False, eval_every=0, optimizer="adamw",
    )  # fmt: skip
    opt_cases = [
        (precision, shard, replace(opt_base, precision=precision, shard_optimizer=shard))
        for precision in ("fp32", "bf16")
        for shard in (False, True)
    ]
    mem_runs = [
        ("memory", prepare(replace(c, out=str(root / f"m{i}")))) for i, (_, _, c) in enumerate(memory_cases)
    ]
    opt_runs = [
        ("optimizer", prepare(replace(c, out=str(root / f"o{i}")))) for i, (_, _, c) in enumerate(opt_cases)
    ]
    mem = spawn(_worker, 2, (mem_runs,), timeout_s=1800)[0] if args.only != "optimizer" else []
    opt = spawn(_worker, 4, (opt_runs,), timeout_s=1800)[0] if args.only != "memory" else []
    spec = mem_runs[0][1].spec
    b = args.microbatch_size
    rows = []
    print(f"activation memory per rank, GPT l=4 h=64 a=4 s={spec.seq_len} b={b}, pp=2 1F1B, m=4 (MiB)")
    print("| precision | recompute | rank | measured peak | runtime model | Korthikanti (cost model) |")
    print("|---|---|---|---:|---:|---:|")
    for (mode, precision, _), gathered in zip(memory_cases, mem, strict=False):
        e = 4 if precision == "fp32" else 2
        for value, _, rank in sorted(gathered, key=lambda g: g[2]):
            in_flight = 2 - rank
            model = runtime_stage_peak_bytes(
                spec, b, mode, layers=2, in_flight=in_flight, element_bytes=e, first=rank == 0, last=rank == 1
            )
            kor = in_flight * 2 * korthikanti_layer_bytes(spec, b, mode, element_bytes=e)
            rows.append({"precision": precision, "recompute": mode, "rank": rank, "measured": value,
                         "runtime_model": model, "korthikanti": kor})  # fmt: skip
            print(
                f"| {precision} | {mode} | {rank} | {value / MIB:.1f} | {model / MIB:.1f} | {kor / MIB:.1f} |"
            )
    print(
        "\noptimizer state per rank (AdamW moments + separate fp32 masters), default model, pp=2 dp=2 (KiB)"
    )
    print("| precision | sharded | rank (pp) | measured | predicted |")
    print("|---|---|---|---:|---:|")
    for (precision, shard, _), gathered in zip(opt_cases, opt, strict=False):
        for value, params, rank in gathered[:2]:  # global ranks 0, 1: dp rank 0's two pp ranks
            # Adam's two fp32 moments; an fp32 master copy under bf16, and of the slice when sharded
            per_param = 8 + (4 if precision != "fp32" or shard else 0)
            predicted = params * per_param / (2 if shard else 1)
            rows.append({"precision": precision, "sharded": shard, "pp_rank": rank, "optimizer_bytes": value,
                         "predicted": predicted})  # fmt: skip
            print(f"| {precision} | {shard} | {rank} | {value / 1024:.0f} | {predicted / 1024:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
