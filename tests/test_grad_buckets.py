"""The data-parallel gradient reduction in buckets (runtime/grad_buckets.py), checked in one process
with the all-reduce recorded: a bucket's all-reduce starts during the stage's last backward, as soon
as its parameters' gradients are final (before the backward reaches the first layer), in place on the
gradient buffer (every ``.grad`` a view of it: no concatenated copy), buckets in index order; the
REDUCE_GRAD starts the rest and the wait divides by the replicas."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from pipewright.ir import REDUCE_GRAD, Action, B
from pipewright.runtime import grad_buckets
from pipewright.runtime.grad_buckets import GradBuckets


class _Reached(torch.autograd.Function):
    """Identity whose backward notes that the backward reached the model's input."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append("input")
        return g, None


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_buckets_start_during_the_last_backward_in_place_and_in_order(monkeypatch) -> None:
    log: list = []
    monkeypatch.setattr(grad_buckets, "BUCKET_BYTES", 64 * 4)  # one 8×8 layer (+ bias) per bucket
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, group=None, async_op=False: log.append(t.data_ptr()) or _Done()
    )
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    params = list(model.parameters())
    buckets = GradBuckets(params, group=None, replicas=2)
    assert len(buckets.ranges) == 4
    x = torch.randn(3, 8)
    want = torch.autograd.grad(model(x).square().sum(), params)
    state = SimpleNamespace(scratch={}, actions=(Action(0, B, 0), Action(0, REDUCE_GRAD, None)), position=0)
    grad_buckets.before_backward(buckets, state, state.actions[0])  # the stage's last backward: armed
    assert all(p.grad.data_ptr() == buckets.views[id(p)].data_ptr() for p in params)
    model(_Reached.apply(x.requires_grad_(), log)).square().sum().backward()
    early = log[: log.index("input")]
    # the last layer's bucket (first in the buffer) started before the backward reached the input, in
    # place on the buffer, and the buckets in index order
    starts = [buckets.buffer[lo:hi].data_ptr() for lo, hi in buckets.ranges]
    assert early and early == starts[: len(early)]
    buckets.start_rest()
    assert [e for e in log if e != "input"] == starts
    buckets.finish(1.0, torch.device("cpu"), "the buckets")
    for p, g in zip(params, want, strict=True):  # a view of the buffer, divided by the replicas
        assert p.grad.data_ptr() == buckets.views[id(p)].data_ptr()
        torch.testing.assert_close(p.grad, g / 2)


def test_unarmed_accumulations_start_nothing(monkeypatch) -> None:
    """Earlier microbatches' backwards (not armed) start no bucket: their gradients are not final."""
    calls: list = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or _Done())
    model = nn.Linear(4, 4)
    buckets = GradBuckets(list(model.parameters()), group=None, replicas=2)
    buckets.install()
    model(torch.randn(2, 4)).sum().backward()
    assert calls == [] and not buckets.armed
