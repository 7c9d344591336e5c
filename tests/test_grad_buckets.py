"""The data-parallel gradient reduction in buckets (runtime/parallel/grad_buckets.py), checked in one process
with the all-reduce recorded: a bucket's all-reduce starts during the stage's last backward, as soon
as its parameters' gradients are final (before the backward reaches the first layer), in place on the
gradient buffer (every ``.grad`` a view of it: no concatenated copy), buckets in index order; the
REDUCE_GRAD starts the rest and the wait divides by the replicas. With a split backward, each bucket
starts as the stage's last W accumulates its layers. On CUDA the wait orders the stream only; the
deadline is checked once at the step's end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipewright.ir import REDUCE_GRAD, Action, B, I, W
from pipewright.models.wgrad import DeferrableLinear, WeightGradStore, deferrable_layers, deferring
from pipewright.runtime.core.distributed_errors import CollectiveTimeout
from pipewright.runtime.parallel import grad_buckets
from pipewright.runtime.parallel.grad_buckets import GradBuckets
from pipewright.runtime.reliability.timeouts import StreamWaits


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


def test_split_backward_buckets_start_during_the_stages_last_w(monkeypatch) -> None:
    """With I and W: the deferred layers' weights are final only in the stage's last W; each bucket
    starts as that W accumulates its layers (the first before the W's last layer), not at REDUCE_GRAD;
    the LayerNorm's gradient, final in the I, waits for the buckets before it (index order)."""
    log: list = []
    monkeypatch.setattr(grad_buckets, "BUCKET_BYTES", 64 * 4)  # one 8×8 layer (+ bias) per bucket
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, group=None, async_op=False: log.append(t.data_ptr()) or _Done()
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), *(DeferrableLinear(8, 8) for _ in range(4)))
    params, layers = list(model.parameters()), deferrable_layers(model)
    x = torch.randn(3, 8)
    want = torch.autograd.grad(model(x).square().sum(), params)
    buckets = GradBuckets(params, group=None, replicas=2)
    assert len(buckets.ranges) == 5
    actions = (Action(0, I, 0), Action(0, W, 0), Action(0, REDUCE_GRAD, None))
    state = SimpleNamespace(scratch={}, actions=actions, position=0)
    store = WeightGradStore()
    grad_buckets.before_backward(buckets, state, actions[0], layers)  # the last I: armed, weights held
    with deferring(layers, store, 0):
        model(x).square().sum().backward()
    assert log == []  # the linear layers' gradients are not final: nothing may start in the I
    state.position = 1
    done = grad_buckets.weights_final(buckets, state, actions[1])

    def accumulated(layer: nn.Module) -> None:
        done(layer)
        log.append("layer")

    store.flush(0, accumulated)
    starts = [buckets.buffer[lo:hi].data_ptr() for lo, hi in buckets.ranges]
    # each linear layer's bucket started right after the W accumulated it, the LayerNorm's with the last
    assert log == [starts[0], "layer", starts[1], "layer", starts[2], "layer", starts[3], starts[4], "layer"]
    buckets.start_rest()
    assert len(buckets.started) == 5 and log.count("layer") == 4
    buckets.finish(1.0, torch.device("cpu"), "the buckets")
    for p, g in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, g / 2)


class _Pending:
    """A CUDA-like Work: ``wait`` orders the stream (recorded, never blocks); complete when told."""

    def __init__(self, log: list) -> None:
        self.log, self.complete = log, False

    def wait(self, timeout=None) -> bool:
        self.log.append("stream waits")
        return True

    def is_completed(self) -> bool:
        self.log.append("polled")
        return self.complete


def test_on_cuda_the_reduction_orders_the_stream_and_its_deadline_is_checked_at_the_steps_end(
    monkeypatch,
) -> None:
    """Finishing a stage's buckets on CUDA neither polls nor blocks the host (the stream waits on the
    all-reduces); the step's one check tests their deadlines: a CollectiveTimeout naming the reduction
    when one never completes."""
    log: list = []
    works = [_Pending(log) for _ in range(2)]
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: works.pop(0))
    model = nn.Linear(4, 4)
    buckets = GradBuckets(list(model.parameters()), group=None, replicas=2)
    buckets.start_rest()
    step, cuda = StreamWaits(), torch.device("cuda")
    first = buckets.started[0]
    buckets.finish(0.05, cuda, "stage 0's buckets", step)
    assert log == ["stream waits"] and step.pending  # no poll, no host wait inside the step
    first.complete = True
    step.check(cuda)
    assert log[1:] == ["polled", "stream waits"] and not step.pending  # checked once, complete
    buckets.start_rest()
    buckets.finish(0.05, cuda, "stage 0's buckets", step)  # the second never completes
    with pytest.raises(CollectiveTimeout, match=r"stage 0's buckets did not complete within 0\.05 s"):
        step.check(cuda)
