"""The executor's default handler per action kind (forward, backward, split backward, sends and
receives, gradient reduction, optimizer step) and the :class:`RunState` they share; see
:mod:`pipewright.runtime.core.executor` for the data flow between stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipewright.ir import REDUCE_GRAD, STEP, Action, B, F, I, Schedule, W
from pipewright.models.wgrad import AccumulateNow, WeightGradStore, deferring
from pipewright.runtime.core.p2p import PipeComm, TensorSpec
from pipewright.runtime.parallel import grad_buckets
from pipewright.runtime.reliability.timeouts import StreamWaits

if TYPE_CHECKING:
    from pipewright.runtime.core.executor import PipelineExecutor

Handler = Callable[["RunState", Action], None]
Key = tuple[int, int]  # (stage, microbatch)
#: ``hook(state, action, output) -> output``: transforms the output of stage ``action.stage``'s forward.
OutputHook = Callable[["RunState", Action, torch.Tensor], torch.Tensor]
#: ``spec(action) -> (shape, dtype)`` of what a receive of a feature's tensor gets.
TensorSpecFn = Callable[[Action], TensorSpec]
#: ``wrapper(kind, handler) -> handler``: what runs for actions of ``kind`` instead of ``handler``
#: (return ``handler`` itself to leave a kind alone).
HandlerWrapper = Callable[[str, Handler], Handler]


@dataclass
class RunState:
    """One iteration's tensors on this rank, shared by the handlers."""

    executor: PipelineExecutor
    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    actions: tuple[Action, ...]
    comm: PipeComm
    position: int = 0
    stage_inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    stage_outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    received: dict[Action, torch.Tensor] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    sent: set[Action] = field(default_factory=set)
    reductions: dict[int, tuple[Any, torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    feeds: dict[Key, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    outbox: dict[Action, torch.Tensor] = field(default_factory=dict)
    scratch: dict[Any, Any] = field(default_factory=dict)  # features' per-iteration values
    waits: StreamWaits = field(default_factory=StreamWaits)  # CUDA: deadlines checked at the step's end


def _forward(state: RunState, a: Action) -> None:
    ex, (s, k) = state.executor, (a.stage, a.microbatch)
    x = state.feeds.pop((s, k), None)
    if x is not None:
        pass
    elif s == 0:
        if state.inputs is None:
            raise ValueError("this rank holds stage 0 but run() got no inputs")
        x = state.inputs[k].to(ex.device, non_blocking=True)
    elif ex.schedule.local(s - 1, s):
        x = state.stage_outputs[(s - 1, k)].detach().requires_grad_()
    else:
        x = state.received.pop(Action(s, ex.fwd_recv, k)).requires_grad_()
    out = ex.stages[s](x)
    state.stage_inputs[(s, k)] = x
    hook = ex.output_hooks.get(s)
    if hook is not None:
        out = hook(state, a, out)
    state.stage_outputs[(s, k)] = out


def loss_hook(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> OutputHook:
    """The output hook of the stage holding the loss: records microbatch k's loss and returns it
    scaled by 1/m (the quantity its backward starts from)."""

    def hook(state: RunState, a: Action, out: torch.Tensor) -> torch.Tensor:
        if state.targets is None:
            raise ValueError(f"this rank computes the loss on stage {a.stage} but run() got no targets")
        loss = loss_fn(out, state.targets[a.microbatch].to(state.executor.device, non_blocking=True))
        state.losses[a.microbatch] = loss.detach()
        return loss / state.executor.schedule.num_microbatches

    return hook


_ACCUMULATE_NOW = AccumulateNow()


def _backward(state: RunState, a: Action, store: WeightGradStore | None = None) -> None:
    ex, (s, k) = state.executor, (a.stage, a.microbatch)
    out = state.stage_outputs.pop((s, k))
    x = state.stage_inputs.pop((s, k))
    grad = state.output_grads.pop((s, k), None)
    if grad is not None or s == ex.last_stage:
        pass  # a feature's gradient, or the last stage's output is the scaled loss
    elif ex.schedule.local(s, s + 1):
        grad = state.input_grads.pop((s + 1, k))
    else:
        grad = state.received.pop(Action(s, ex.bwd_recv, k))
    buckets = grad_buckets.of(ex.stages[s])
    if buckets is not None:  # the stage's gradients in its bucket buffer; hooks armed in its last backward
        grad_buckets.before_backward(buckets, state, a, ex.deferrable[s])
    # a full B accumulates its weight gradients fused into .grad; I hands them to the stage's W store
    with deferring(ex.deferrable[s], _ACCUMULATE_NOW if store is None else store, k):
        torch.autograd.backward(out, grad)
    if s > 0:
        state.input_grads[(s, k)] = x.grad


def _input_backward(state: RunState, a: Action) -> None:
    _backward(state, a, state.executor.wgrad[a.stage])


def _weight_backward(state: RunState, a: Action) -> None:
    ex = state.executor
    buckets = grad_buckets.of(ex.stages[a.stage])
    # the stage's last W: each layer's bucket may start as soon as the layer's weights are final
    done = grad_buckets.weights_final(buckets, state, a) if buckets is not None else None
    ex.wgrad[a.stage].flush(a.microbatch, done)


def _recv(state: RunState, a: Action) -> None:
    state.received[a] = state.comm.wait_recv(a)


def _send(state: RunState, a: Action) -> None:
    """Send ``a`` and the send actions directly after it in one batch."""
    if a in state.sent:
        return
    batch = []
    actions = state.actions
    sources = state.executor.send_sources
    for i in range(state.position, len(actions)):  # no slice: a copy of the tail per send is O(n²)
        b = actions[i]
        source = sources.get(b.kind)
        if source is None:
            break
        batch.append((b, source(state, b)))
        state.sent.add(b)
    state.comm.send(batch)


def _stage_output(state: RunState, a: Action) -> torch.Tensor:
    return state.stage_outputs[(a.stage, a.microbatch)].detach()


def _input_grad(state: RunState, a: Action) -> torch.Tensor:
    return state.input_grads.pop((a.stage, a.microbatch))


def _from_outbox(state: RunState, a: Action) -> torch.Tensor:
    return state.outbox.pop(a)


#: Where a send finds its tensor, by the ``P2P.tensor`` name (other names: the outbox).
CORE_TENSORS: dict[str, Callable[[RunState, Action], torch.Tensor]] = {
    "activation": _stage_output,
    "activation_grad": _input_grad,
}


def _reduce_grad(state: RunState, a: Action) -> None:
    start_reduction(state, a.stage)


def start_reduction(state: RunState, stage: int, dtype: torch.dtype | None = None) -> None:
    """Start stage's asynchronous data-parallel all-reduce of its gradients (zeros for a parameter that
    has none), flattened into one buffer, summed in ``dtype`` (default: the gradients' own), over the
    mesh's gradient group (dp, or dp × cp with context parallelism: one all-reduce for both);
    :func:`finish_reduction` waits for it and writes the average back."""
    ex = state.executor
    if ex.mesh.dp == 1:
        return
    buckets = grad_buckets.of(ex.stages[stage])
    if dtype is None and buckets is not None and grad_buckets.installed(state, stage):
        buckets.start_rest()  # the buckets not started during the stage's last backward
        state.reductions[stage] = buckets
        return
    params = [p for p in ex.stages[stage].parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) if dtype is None else g.reshape(-1).to(dtype) for g in grads])
    work = dist.all_reduce(flat, group=ex.mesh.grad_group, async_op=True)
    state.reductions[stage] = (work, flat, grads, ex.mesh.grad_replicas)
    shared = {id(p) for s, m in ex.stages.items() if s != stage for p in m.parameters()}
    if dtype is None and not shared.intersection(map(id, params)):
        # the executor's own reduction: in buckets during the backward from now on (not for a stage
        # sharing a parameter with another stage of this rank: one .grad cannot view two buffers)
        grad_buckets.enable(ex.stages[stage], params, ex.mesh.grad_group, ex.mesh.grad_replicas)


def finish_reduction(state: RunState, stage: int) -> None:
    """Wait for stage's gradient all-reduce (if any) and write the averaged gradients back."""
    pending = state.reductions.pop(stage, None)
    if pending is None:
        return
    ex = state.executor
    if isinstance(pending, grad_buckets.GradBuckets):
        what = f"{ex.where()}: REDUCE_GRAD({stage}): the dp all-reduce of stage {stage}'s gradient buckets"
        pending.finish(ex.collective_timeout_s, ex.device, what, state.waits)
        return
    work, flat, grads, *replicas = pending  # the replicas it sums over (default: dp)
    what = f"{ex.where()}: REDUCE_GRAD({stage}): the dp all-reduce of stage {stage}'s gradients"
    state.waits.wait(work, ex.collective_timeout_s, ex.device, what)
    flat /= replicas[0] if replicas else ex.mesh.dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _step(state: RunState, a: Action) -> None:
    finish_reduction(state, a.stage)
    if state.executor.step_fn is not None:
        state.executor.step_fn(a.stage, a.microbatch)


def default_handlers() -> dict[str, Handler]:
    """A fresh dict of the core kinds' handlers."""
    return {
        F: _forward,
        B: _backward,
        I: _input_backward,
        W: _weight_backward,
        REDUCE_GRAD: _reduce_grad,
        STEP: _step,
    }


def _p2p_handlers(schedule: Schedule) -> dict[str, Handler]:
    """Every point-to-point kind of the schedule's registry is handled from its metadata."""
    return {
        name: (_send if spec.p2p.role == "send" else _recv)
        for name, spec in schedule.kinds.items()
        if spec.p2p is not None
    }
