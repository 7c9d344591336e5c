"""The context-parallel ring attention's backward, before and after overlapping its dK/dV exchanges,
on this CPU: cp gloo processes, one ring, the same tensors, paired alternating rounds.

"after" is ``pipewright.runtime.parallel.cp.ring.RingAttention`` as checked out: the diagonal block's dK/dV
stays
home, cp − 1 fp32 accumulator transfers, each waited after the next block's computation. "before" is
the same file at revision ``--before`` (loaded from git; default the last revision whose backward waited
each of its cp accumulator transfers as soon as it started it). Both run over one
:class:`~pipewright.runtime.parallel.cp.ring.DistRing` on the same q, k, v [b, heads, S/cp, d] (fp32).

Each round times, for each of the two in turn (the order swapped every round), one forward (not
timed) and then its backward (``out.backward(g)``), after a barrier; a rank's time is its own wall
seconds, a round's the slowest rank's. Printed: the median backward seconds of each, the median of
the per-round ratios after / before, and the exposed wait per backward (``DistRing.waited``: seconds
spent in ``wait`` on backward exchanges, rank 0, median).

    PYTHONPATH=src python benchmarks/bench_cp_ring.py [--cp 2] [--seq-len 512] [--heads 8]
        [--head-dim 64] [--rounds 20] [--before 95c8712]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from pipewright.runtime.parallel.cp.ring import DistRing, RingAttention
from pipewright.runtime.setup.launch import spawn

ROOT = Path(__file__).resolve().parents[1]
RING = "src/pipewright/runtime/parallel/cp/ring.py"


def source_at(revision: str) -> str:
    """The text of ``runtime/parallel/cp/ring.py`` at git ``revision``."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:{RING}"], check=True, capture_output=True, text=True
    ).stdout


def module_of(source: str, name: str = "ring_before") -> ModuleType:
    """``source`` imported as a module ``name`` of its own (from a temporary file)."""
    path = Path(tempfile.mkdtemp(prefix="ring-before-")) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _backward_seconds(attention, ring: DistRing, tensors: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """(this rank's backward seconds, its backward wait) of one forward + backward of ``attention``."""
    q, k, v, g = tensors
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention.apply(q, k, v, ring)
    waited = ring.waited[True]
    dist.barrier()
    start = time.perf_counter()
    out.backward(g)
    return time.perf_counter() - start, ring.waited[True] - waited


def _worker(rank: int, args: argparse.Namespace, source: str) -> dict | None:
    torch.set_num_threads(1)
    before = module_of(source)
    cp = dist.get_world_size()
    ring = DistRing(dist.group.WORLD, rank, cp, (rank + 1) % cp, (rank - 1) % cp, back_group=dist.new_group())
    n = args.seq_len // cp
    gen = torch.Generator().manual_seed(rank)
    shape = (args.batch, args.heads, n, args.head_dim)
    tensors = tuple(torch.randn(shape, generator=gen) for _ in range(4))
    variants = {"before": before.RingAttention, "after": RingAttention}
    times: dict[str, list[float]] = {name: [] for name in variants}
    waits: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):  # round 0 warms up
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds, waited = _backward_seconds(variants[name], ring, tensors)
            slowest = torch.tensor([seconds])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if r > 0:
                times[name].append(slowest.item())
                waits[name].append(waited)
    return {"times": times, "waits": waits} if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--before", default="95c8712", help="git revision of the backward to compare against")
    args = p.parse_args(argv)
    result = spawn(_worker, args.cp, (args, source_at(args.before)), backend="gloo", timeout_s=3600)[0]
    times, waits = result["times"], result["waits"]
    ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
    print(
        f"cp={args.cp} S={args.seq_len} b={args.batch} heads={args.heads} d={args.head_dim} "
        f"rounds={args.rounds} (fp32, gloo, one thread per process)"
    )
    for name in ("before", "after"):
        print(
            f"  {name:6s} backward {statistics.median(times[name]) * 1e3:8.2f} ms "
            f"(min {min(times[name]) * 1e3:.2f}, max {max(times[name]) * 1e3:.2f}); "
            f"waited {statistics.median(waits[name]) * 1e3:.2f} ms"
        )
    print(f"  after / before: median of paired ratios {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
