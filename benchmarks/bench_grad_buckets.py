"""The data-parallel gradient reduction in buckets (``runtime/parallel/grad_buckets.py``) against the
concatenated
all-reduce after the backward it replaced, at dp = ``--dp`` gloo processes on this CPU: a stage of
``--layers`` ``nn.Linear(h, h)`` layers, one microbatch's backward armed as the stage's last.

Printed: when the buckets' all-reduces start, as a fraction of the backward's duration (the
concatenated one starts at 100 %: after it); the bytes the reduction allocates (every storage an
operation returns during it that did not exist before, counted with a ``TorchDispatchMode``); the
median seconds from the backward's start to averaged gradients, over ``--repeats`` alternating
rounds.

``--split``: the stage's layers are ``DeferrableLinear`` and its last backward is split into I and W
(zero-bubble); the buckets marked final by the last W as it accumulates each layer (now) against all
of them started at REDUCE_GRAD after the W (before): when they start as a fraction of the W, and the
median seconds from the I's start to averaged gradients.

    PYTHONPATH=src python benchmarks/bench_grad_buckets.py [--dp 2] [--layers 8] [--hidden 512] [--split]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipewright.ir import REDUCE_GRAD, Action, B, I, W
from pipewright.models.wgrad import DeferrableLinear, WeightGradStore, deferrable_layers, deferring
from pipewright.runtime.parallel import grad_buckets
from pipewright.runtime.setup.launch import spawn


class _NewStorages(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.seen = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        existing = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in existing and key not in self.seen:
                    self.seen.add(key)
                    self.bytes += t.untyped_storage().nbytes()
        return out


def _concatenated(params, d: int) -> int:
    """The reduction before: one flat copy of every gradient, all-reduced, copied back; its bytes."""
    with _NewStorages() as seen:
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, async_op=True).wait()
        flat /= d
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return seen.bytes


def _worker(rank: int, args: argparse.Namespace) -> dict | None:
    torch.manual_seed(0)
    d = dist.get_world_size()
    model = nn.Sequential(*(nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)))
    params = list(model.parameters())
    x = torch.randn(args.batch, args.hidden)
    grad_buckets.BUCKET_BYTES = args.bucket_mib << 20
    buckets = grad_buckets.GradBuckets(params, None, d)
    starts: list[float] = []
    plain = dist.all_reduce

    def timed(t, *a, **k):
        starts.append(time.perf_counter())
        return plain(t, *a, **k)

    out: dict = {"before_s": [], "after_s": [], "first": [], "last": []}
    for i in range(2 + args.repeats):
        for name in ("before", "after") if i % 2 else ("after", "before"):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            if name == "after":
                state = SimpleNamespace(
                    scratch={}, actions=(Action(0, B, 0), Action(0, REDUCE_GRAD, None)), position=0
                )
                grad_buckets.before_backward(buckets, state, state.actions[0])
                starts.clear()
                dist.all_reduce = timed
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            t1 = time.perf_counter()
            if name == "after":
                with _NewStorages() as seen:
                    buckets.start_rest()
                    buckets.finish(60.0, torch.device("cpu"), "buckets")
                dist.all_reduce = plain
                out["after_bytes"] = seen.bytes
                if i >= 2:
                    out["first"].append((starts[0] - t0) / (t1 - t0))
                    out["last"].append((starts[-1] - t0) / (t1 - t0))
            else:
                out["before_bytes"] = _concatenated(params, d)
            if i >= 2:
                out[f"{name}_s"].append(time.perf_counter() - t0)
    out["params"] = sum(p.numel() for p in params)
    out["buckets"] = len(buckets.ranges)
    return out if rank == 0 else None


def _split_worker(rank: int, args: argparse.Namespace) -> dict | None:
    """I then W of one microbatch, the buckets started during the W (now) or at REDUCE_GRAD (before)."""
    torch.manual_seed(0)
    d = dist.get_world_size()
    model = nn.Sequential(*(DeferrableLinear(args.hidden, args.hidden) for _ in range(args.layers)))
    params, layers = list(model.parameters()), deferrable_layers(model)
    x = torch.randn(args.batch, args.hidden)
    grad_buckets.BUCKET_BYTES = args.bucket_mib << 20
    buckets = grad_buckets.GradBuckets(params, None, d)
    starts: list[float] = []
    plain = dist.all_reduce

    def timed(t, *a, **k):
        starts.append(time.perf_counter())
        return plain(t, *a, **k)

    out: dict = {"before_s": [], "after_s": [], "first": [], "last": []}
    actions = (Action(0, I, 0), Action(0, W, 0), Action(0, REDUCE_GRAD, None))
    for i in range(2 + args.repeats):
        for name in ("before", "after") if i % 2 else ("after", "before"):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            state = SimpleNamespace(scratch={}, actions=actions, position=0)
            store = WeightGradStore()
            starts.clear()
            dist.all_reduce = timed
            t0 = time.perf_counter()
            grad_buckets.before_backward(buckets, state, actions[0], layers if name == "after" else ())
            with deferring(layers, store, 0):
                model(x).square().mean().backward()
            t1 = time.perf_counter()
            state.position = 1
            store.flush(
                0, grad_buckets.weights_final(buckets, state, actions[1]) if name == "after" else None
            )
            t2 = time.perf_counter()
            buckets.start_rest()
            buckets.finish(60.0, torch.device("cpu"), "buckets")
            dist.all_reduce = plain
            if i >= 2:
                out[f"{name}_s"].append(time.perf_counter() - t0)
                if name == "after":
                    out["first"].append((starts[0] - t1) / (t2 - t1))
                    out["last"].append((starts[-1] - t1) / (t2 - t1))
    out["params"], out["buckets"] = sum(p.numel() for p in params), len(buckets.ranges)
    return out if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--split", action="store_true", help="I and W: buckets during the last W")
    args = parser.parse_args()
    r = spawn(_split_worker if args.split else _worker, args.dp, (args,), backend="gloo", timeout_s=600)[0]
    n = r["params"]
    if args.split:
        size = f"{r['buckets']} buckets of ~{args.bucket_mib} MiB"
        print(f"dp={args.dp}, {args.layers} × DeferrableLinear({args.hidden}, {args.hidden}), I then W: "
              f"{n:,} fp32 parameters, {size} (gloo, CPU)")  # fmt: skip
        first, last = statistics.median(r["first"]), statistics.median(r["last"])
        print(
            f"  during the W: first all-reduce started at {100 * first:.0f} % of the W, "
            f"last at {100 * last:.0f} %"
        )
        for name, what in (("before", "at REDUCE_GRAD"), ("after", "during the W")):
            ms = statistics.median(r[f"{name}_s"]) * 1e3
            print(f"  buckets {what:<14} I → averaged gradients {ms:7.1f} ms (median)")
        return
    print(f"dp={args.dp}, {args.layers} × Linear({args.hidden}, {args.hidden}): {n:,} fp32 parameters, "
          f"{r['buckets']} buckets of ~{args.bucket_mib} MiB (gloo, CPU)")  # fmt: skip
    first, last = statistics.median(r["first"]), statistics.median(r["last"])
    when = f"first all-reduce started at {100 * first:.0f} % of the backward, last at {100 * last:.0f} %"
    print(f"  buckets: {when}")
    for name in ("before", "after"):
        extra = r[f"{name}_bytes"]
        ms = statistics.median(r[f"{name}_s"]) * 1e3
        print(f"  {name:<6} reduction allocates {extra / n:4.2f} bytes/parameter ({extra / 2**20:6.1f} MiB); "
              f"backward → averaged gradients {ms:7.1f} ms (median)")  # fmt: skip


if __name__ == "__main__":
    main()
