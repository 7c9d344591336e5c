"""ZeRO-1's parameter all-gather after the step (``runtime/parallel/zero.py``
``_FlatShard.gather_into_params``):
the bytes of the tensors it allocates and its time, against the gather it replaced (a list of d fp32
slices, ``all_gather``, then ``torch.cat`` — reproduced here as ``before``), at dp = ``--dp`` gloo
processes on this CPU, for ``--params`` parameters of ``--dtype``.

Bytes: every storage an operation returns during the call that did not exist before it (the
transient), counted with a ``TorchDispatchMode``; per parameter of the model. Time: median of
``--repeats`` calls, after 2 warm-up, the two gathers alternating.

    PYTHONPATH=src python benchmarks/bench_zero_gather.py [--dp 2] [--params 4000000] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipewright.runtime.parallel.zero import _FlatShard
from pipewright.runtime.setup.launch import spawn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _NewStorages(TorchDispatchMode):
    """Bytes of the storages operations return that are new since entering."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.seen, self.bytes = set(existing), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.seen:
                    self.seen.add(key)
                    self.bytes += t.untyped_storage().nbytes()
        return out


def before(flat: _FlatShard, group=None) -> None:
    """The gather as it was: d fp32 slices in a list, ``all_gather``, ``torch.cat``, cast on copy."""
    d = dist.get_world_size(group)
    parts = [torch.empty_like(flat.master.data.view(-1)) for _ in range(d)]
    dist.all_gather(parts, flat.master.data.view(-1).contiguous(), group=group)
    full = torch.cat(parts)
    with torch.no_grad():
        for p, off in zip(flat.params, flat.offsets, strict=True):
            p.copy_(full[off : off + p.numel()].view_as(p))


def _worker(rank: int, args: argparse.Namespace) -> dict | None:
    dtype = DTYPES[args.dtype]
    side = int((args.params / 8) ** 0.5)
    params = [nn.Parameter(torch.randn(side, side).to(dtype)) for _ in range(8)]
    flat = _FlatShard(params, dist.get_world_size(), rank, True, torch.device("cpu"))
    existing = {p.untyped_storage().data_ptr() for p in params} | {flat.master.untyped_storage().data_ptr()}
    gathers = {"before": lambda: before(flat), "after": lambda: flat.gather_into_params(None)}
    result: dict = {}
    for name, fn in gathers.items():
        with _NewStorages(existing) as seen:
            fn()
        result[f"{name}_bytes"] = seen.bytes
        result[f"{name}_s"] = []
    for i in range(2 + args.repeats):
        for name, fn in gathers.items() if i % 2 else reversed(gathers.items()):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                result[f"{name}_s"].append(time.perf_counter() - t0)
    result["params"] = sum(p.numel() for p in params)
    return result if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    r = spawn(_worker, args.dp, (args,), backend="gloo", timeout_s=600)[0]
    n = r["params"]
    print(f"ZeRO-1 parameter gather, dp={args.dp}, {n:,} parameters in {args.dtype} (gloo, CPU)")
    for name in ("before", "after"):
        ms = statistics.median(r[f"{name}_s"]) * 1e3
        print(f"  {name:<6}  transient {r[f'{name}_bytes'] / n:5.2f} bytes/parameter "
              f"({r[f'{name}_bytes'] / 2**20:7.1f} MiB)  median {ms:7.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
