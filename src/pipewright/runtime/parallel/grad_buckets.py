"""A stage's data-parallel gradient reduction in buckets started during its last backward (PyTorch DDP's
and Megatron-LM's scheme), on the gradients' own memory.

The stage's gradients live in one flat buffer (each parameter's ``.grad`` a view of it, laid out in
reverse registration order — roughly the order the backward produces them), cut into buckets of
about :data:`BUCKET_BYTES`. During the stage's last backward action of the step (its last B or I) a
hook on each parameter's gradient accumulation marks the parameter final; a bucket whose parameters
are all final starts its asynchronous all-reduce at once, in place on its slice of the buffer — no
concatenated copy. With a split backward (zero-bubble I and W) the deferred layers' weights get their
gradients outside autograd, in the W actions: when the stage's last W comes after its last I, those
weights are held back from the hooks and marked final layer by layer as that last W accumulates
them (:func:`weights_final`), so a bucket starts after the last W of its parameters, during the W.
Buckets start strictly in index order (a ready bucket waits for the ones before it), so every
replica issues the same all-reduces in the same order, as NCCL's one stream per communicator needs.
The stage's REDUCE_GRAD action starts whatever has not started (a parameter that got no gradient);
the STEP (or the end of the iteration) waits for them and divides the buffer by the replicas, which
leaves the average in every ``.grad``.

A stage reduces this way from its second iteration on: the first iteration's REDUCE_GRAD, run by the
executor's default handler (not ZeRO-1's reduce-scatter, the experts' groups or an fp32 sum, which
keep their own reductions), enables it (:func:`enable`); until the buffer exists the gradients are
the autograd's own tensors and are reduced as one concatenation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipewright.ir import B, I, W
from pipewright.runtime.reliability.timeouts import StreamWaits

#: Target bytes per bucket (DDP's default is 25 MiB).
BUCKET_BYTES = 25 << 20


class GradBuckets:
    """One stage's flat gradient buffer and its buckets (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, replicas: int) -> None:
        self.params = list(reversed(list(params)))
        self.group, self.replicas = group, replicas
        dtype = self.params[0].dtype
        total = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(total, dtype=dtype, device=self.params[0].device)
        self.views: dict[int, torch.Tensor] = {}
        self.bucket_of: dict[int, int] = {}
        self.ranges: list[tuple[int, int]] = []  # [lo, hi) of each bucket in the buffer
        self.members: list[int] = []  # parameters per bucket
        offset, lo, nbytes = 0, 0, 0
        for p in self.params:
            self.views[id(p)] = self.buffer[offset : offset + p.numel()].view_as(p)
            self.bucket_of[id(p)] = len(self.ranges)
            offset += p.numel()
            nbytes += p.numel() * p.element_size()
            if nbytes >= BUCKET_BYTES:
                self._close(lo, offset)
                lo, nbytes = offset, 0
        if offset > lo or not self.ranges:
            self._close(lo, offset)
        self.armed = False
        self.held: set[int] = set()  # parameters made final by W (:meth:`mark`), not by the hooks
        self.done: set[int] = set()  # the parameters final this iteration
        self.final: list[int] = [0] * len(self.ranges)
        self.started: list[Any] = []  # the works of buckets 0..len-1, started in order
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _close(self, lo: int, hi: int) -> None:
        self.ranges.append((lo, hi))
        self.members.append(sum(1 for b in self.bucket_of.values() if b == len(self.ranges) - 1))

    def install(self) -> None:
        """Before the stage's first backward of an iteration: every ``.grad`` a view of the buffer
        (zeros where there was none; the values kept where there were)."""
        for p in self.params:
            view = self.views[id(p)]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            else:
                continue
            p.grad = view

    def arm(self, held: Iterable[int] = ()) -> None:
        """From the stage's last backward action on, a gradient accumulation is a parameter's last,
        except for the parameters (ids) ``held``: their last comes in a later W (:meth:`mark`)."""
        self.armed, self.held = True, set(held)

    def _accumulated(self, p: nn.Parameter) -> None:
        if self.armed and id(p) not in self.held:
            self._final(p)

    def mark(self, params: Iterable[nn.Parameter]) -> None:
        """``params``' gradients are final (the stage's last W accumulated them): start what is ready."""
        for p in params:
            if id(p) in self.bucket_of:
                self._final(p)

    def _final(self, p: nn.Parameter) -> None:
        if id(p) not in self.done:
            self.done.add(id(p))
            self.final[self.bucket_of[id(p)]] += 1
            self._start_ready()

    def _start_ready(self) -> None:
        """Start, in index order, every bucket whose parameters are all final and whose predecessors
        have started."""
        while len(self.started) < len(self.ranges):
            b = len(self.started)
            if self.final[b] < self.members[b]:
                return
            lo, hi = self.ranges[b]
            self.started.append(dist.all_reduce(self.buffer[lo:hi], group=self.group, async_op=True))

    def start_rest(self) -> None:
        """At REDUCE_GRAD: every parameter is final; start the buckets not started, in order."""
        self.install()  # a parameter that got no gradient at all this iteration (zeros)
        self.final = list(self.members)
        self._start_ready()

    def finish(
        self, timeout_s: float, device: torch.device, what: str, waits: StreamWaits | None = None
    ) -> None:
        """Wait for every bucket (at most ``timeout_s`` each) and average: buffer / replicas. With
        ``waits`` (the step's), on CUDA only the stream waits; ``waits.check`` tests the deadlines."""
        mine = waits is None
        waits = StreamWaits() if waits is None else waits
        for work in self.started:
            waits.wait(work, timeout_s, device, what)
        if mine:
            waits.check(device)
        self.buffer /= self.replicas
        self.armed, self.started, self.done, self.held = False, [], set(), set()
        self.final = [0] * len(self.ranges)


#: Each stage module's buckets, once enabled (the module's life; every executor over it shares them).
_OF: weakref.WeakKeyDictionary[nn.Module, GradBuckets] = weakref.WeakKeyDictionary()


def of(stage: nn.Module) -> GradBuckets | None:
    """``stage``'s buckets (None until :func:`enable`)."""
    return _OF.get(stage)


def enable(stage: nn.Module, params: Sequence[nn.Parameter], group: Any, replicas: int) -> None:
    """Reduce ``stage``'s gradients in buckets from its next iteration on (its parameters all of one
    dtype and device; else it keeps the concatenated reduction)."""
    if stage in _OF or not params:
        return
    if len({(p.dtype, p.device) for p in params}) == 1:
        _OF[stage] = GradBuckets(params, group, replicas)


def _last_backward(state: Any) -> dict[int, tuple[int, int | None]]:
    """Per stage, the position of its last B or I in this iteration's row (where autograd's gradients
    become final) and of its last W when that comes later (where the deferred weights' do), cached
    in the run state."""
    last = state.scratch.get("grad_buckets.last")
    if last is None:
        backward = {a.stage: i for i, a in enumerate(state.actions) if a.kind in (B, I)}
        weight = {a.stage: i for i, a in enumerate(state.actions) if a.kind == W}
        last = {s: (i, weight[s] if weight.get(s, -1) > i else None) for s, i in backward.items()}
        state.scratch["grad_buckets.last"] = last
    return last


def installed(state: Any, stage: int) -> bool:
    """Whether ``stage``'s gradients were put in its buffer this iteration (its first backward)."""
    return stage in state.scratch.get("grad_buckets.installed", set())


def before_backward(
    buckets: GradBuckets, state: Any, action: Any, deferred: Sequence[nn.Module] = ()
) -> None:
    """Before each backward (B or I) of the stage: its first in the iteration puts the gradients in the
    buffer; its last arms the accumulation hooks — for all but the ``deferred`` layers' parameters
    when a W comes later (:func:`weights_final` marks those)."""
    done = state.scratch.setdefault("grad_buckets.installed", set())
    if action.stage not in done:
        buckets.install()
        done.add(action.stage)
    last, weight = _last_backward(state).get(action.stage, (None, None))
    if last == state.position:
        held = (
            () if weight is None else (id(p) for layer in deferred for p in layer.parameters(recurse=False))
        )
        buckets.arm(held)


def weights_final(buckets: GradBuckets, state: Any, action: Any) -> Callable[[nn.Module], None] | None:
    """For the stage's last W (after its last backward): ``done(layer)``, which marks the layer's
    parameters final as the W accumulates them; None for any other W."""
    last = _last_backward(state).get(action.stage, (None, None))[1]
    if last != state.position or not buckets.armed:
        return None
    return lambda layer: buckets.mark(_own_parameters(layer))


def _own_parameters(layer: Any) -> list[torch.Tensor]:
    """The parameters a deferred W pass updates: a module's own, or those of the ``(weight, bias)``
    record a store holds in its place (tensor-parallel layers' ``DeferredParams``, Hugging Face
    transposed linears)."""
    if isinstance(layer, nn.Module):
        return list(layer.parameters(recurse=False))
    return [p for p in layer if isinstance(p, torch.Tensor)]
