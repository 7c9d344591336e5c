"""The pipeline executor: runs this rank's actions of a lowered schedule on real ``nn.Module`` stages.

One handler per action kind, looked up in a dict the executor builds from :func:`default_handlers`
plus the ``handlers`` the caller passes (features add kinds such as K-FAC tasks without editing this
file). A handler is ``handler(state, action)``; ``state`` (:class:`RunState`) holds the iteration's
tensors and gives access to the executor (stages, mesh, process groups, communication, weight-gradient
stores). Point-to-point kinds are handled from their :class:`~pipewright.kinds.P2P` metadata: a send
takes the tensor named by ``p2p.tensor`` (core: a stage's output ``"activation"`` or its input gradient
``"activation_grad"``; any other name: what a feature's handler left in ``state.outbox[send action]``),
a receive is posted ahead with the shape ``tensor_specs[name](action)`` gives and lands in
``state.received[receive action]``.

Data flow between stages (one tensor per microbatch crosses each stage boundary):

* F(s, k): input = a tensor a feature fed (``state.feeds[(s, k)]``), microbatch k (stage 0), the
  previous stage's output on this rank (local hand-off, V placement), or the tensor RECV_F(s, k)
  received. A stage's **output hook** (``output_hooks[s]``) may transform its output: the default
  puts the loss hook on the stage the layout's output layer sits on (the last by default), which
  computes ``loss_fn(output, target_k) / m`` so summed gradients over m microbatches equal those of the
  mean loss of the whole batch (and the dp all-reduce averages over replicas).
* B(s, k): full backward of stage s from the gradient of its output — one a feature left in
  ``state.output_grads[(s, k)]``, the next stage's input gradient (local or received), or none when the
  output is the scaled loss; I(s, k): the same with weight gradients deferred (weight-gradient stores);
  W(s, k) computes them. The gradient w.r.t. the stage input is kept for SEND_B or the local stage s − 1.
* REDUCE_GRAD(s): asynchronous all-reduce (average) of stage s's gradients over the dp group, waited
  before STEP(s) and at the end of the iteration. STEP(s[, k]) calls ``step_fn(s, k)``.

Every wait is bounded: receives by ``recv_timeout_s``
(:class:`~pipewright.runtime.core.distributed_errors.RecvTimeout`),
collectives by ``collective_timeout_s``
(:class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout`; see
:mod:`pipewright.runtime.reliability.timeouts`).

Handler wrappers (``handler_wrappers=`` or :meth:`PipelineExecutor.wrap_handlers`) are the extension
point for code that runs around every action without replacing a kind's handler: a wrapper is
``wrapper(kind, handler) -> handler`` and is applied to every kind's handler, core, point-to-point and
features' alike (the run guard's position records, fault injection and non-finite bookkeeping; the
asynchronous weight policies).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipewright.deps import peer_stage
from pipewright.ir import STEP, Action, F, I, Schedule
from pipewright.models.wgrad import WeightGradStore, deferrable_layers
from pipewright.passes.grad_reduce import add_grad_reduction
from pipewright.passes.lower import lower
from pipewright.passes.validate import validate as validate_schedule
from pipewright.runtime.core.distributed_errors import (
    ActionError,
    CollectiveTimeout,
    DistributedError,
    LayoutError,
)
from pipewright.runtime.core.handlers import (  # noqa: F401  (RunState & co. are this module's API too)
    CORE_TENSORS,
    Handler,
    HandlerWrapper,
    Key,
    OutputHook,
    RunState,
    TensorSpecFn,
    _from_outbox,
    _p2p_handlers,
    default_handlers,
    finish_reduction,
    loss_hook,
    start_reduction,
)
from pipewright.runtime.core.p2p import PipeComm, TensorSpec, channel_pairs
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.profiling.measured_timeline import ActionClock
from pipewright.runtime.reliability.hang import mesh_rank_label
from pipewright.runtime.reliability.timeouts import is_timeout, wait_work
from pipewright.runtime.setup import nccl_rules
from pipewright.timeline import Span

log = logging.getLogger(__name__)


def _loss_values(losses: dict[int, torch.Tensor]) -> list[float]:
    """The losses by microbatch as floats, read in one device transfer (not one sync per microbatch)."""
    if not losses:
        return []
    return torch.stack([losses[k] for k in sorted(losses)]).tolist()


def _spec_map(value: Any, num_stages: int) -> dict[int, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    return dict.fromkeys(range(1, num_stages), value)


def _runnable(
    schedule: Schedule, mesh: ParallelMesh, *, step_reduces_gradients: bool, validate: bool
) -> Schedule:
    """``schedule`` lowered, given REDUCE_GRAD actions when dp > 1, and validated (when ``validate``)."""
    schedule = lower(schedule)
    if mesh.dp > 1:
        if not step_reduces_gradients and any(
            a.kind == STEP and a.microbatch is not None for row in schedule.actions for a in row
        ):
            log.warning(
                "%s steps per microbatch but its gradients are all-reduced over dp once per iteration; "
                "replicas step on unreduced gradients",
                schedule.name,
            )
        schedule = add_grad_reduction(schedule)
    if validate:
        validate_schedule(schedule)
    return schedule


class PipelineExecutor:
    """Runs one rank's part of a pipeline schedule; construct on every rank (collective: opens channels).

    ``schedule``: compute-only or lowered, for ``mesh.pp`` ranks; it is lowered, given REDUCE_GRAD
    actions when ``mesh.dp > 1`` and it has none, and validated. ``stages`` maps each stage this pp
    rank holds to its module. ``boundary_shape`` is the per-microbatch shape of the tensor entering a
    stage (one tuple for all, or a dict stage → shape), ``dtype`` likewise. ``step_fn(stage, mb)`` is
    called by STEP actions (``mb`` None after a flush). ``recv_depth``: receives posted ahead per
    channel. Default on CUDA (and under NCCL's rules, :mod:`~pipewright.runtime.setup.nccl_rules`): the
    schedule's number of stages, which bounds the microbatches in flight of the usual schedules, so
    receive buffers stay bounded by them; on plain gloo all at iteration start (host memory is cheap,
    and gloo's rendezvous makes a late-posted receive cost CPU time). ``recv_window``: instead,
    receives are posted this many actions ahead. ``record``: measure a span
    per action — wall clock on the CPU, CUDA events on CUDA, read after the step with one synchronize
    (the per-action loop never synchronises: :meth:`device_sync` runs at most once per step).
    ``scatter_gather`` (tp > 1,
    boundary tensors identical on the tp ranks of a stage, as after Megatron's row-parallel
    all-reduce): each tp rank sends 1/tp of a boundary tensor and the receivers all-gather it
    (Megatron-LM's scatter/gather optimisation).

    Extension points (a plugin's executor parts, :class:`pipewright.runtime.core.plugin.ExecutorParts`):
    ``handlers`` per kind; ``output_hooks`` per stage (default: the loss hook of ``loss_fn`` on
    ``loss_stage``, the last stage unless the layout puts the output layer elsewhere; pass
    ``loss_fn=None`` when a feature computes the loss); ``tensor_specs`` (shape and dtype of the
    features' point-to-point tensors, by ``P2P.tensor`` name); ``groups``: named process groups for
    collectives beyond dp/pp/tp (:meth:`group`); ``handler_wrappers``: applied to every handler, first
    one innermost (:meth:`wrap_handlers`); ``step_reduces_gradients``: the STEP handler (or a wrapper
    installing one) all-reduces over dp itself. ``collective_timeout_s`` bounds the executor's own
    collective waits (gradient all-reduce, loss all-reduce, timing barrier).
    """

    def __init__(
        self,
        schedule: Schedule,
        mesh: ParallelMesh,
        stages: Mapping[int, nn.Module],
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        boundary_shape: tuple[int, ...] | Mapping[int, tuple[int, ...]],
        dtype: torch.dtype | Mapping[int, torch.dtype] = torch.float32,
        device: torch.device | str | None = None,
        handlers: Mapping[str, Handler] | None = None,
        step_fn: Callable[[int, int | None], None] | None = None,
        recv_timeout_s: float = 300.0,
        recv_window: int | None = None,
        recv_depth: int | None = None,
        record: bool = False,
        validate: bool = True,
        scatter_gather: bool = False,
        loss_stage: int | None = None,
        output_hooks: Mapping[int, OutputHook] | None = None,
        tensor_specs: Mapping[str, TensorSpecFn] | None = None,
        groups: Mapping[str, Any] | None = None,
        handler_wrappers: Sequence[HandlerWrapper] = (),
        collective_timeout_s: float = 600.0,
        step_reduces_gradients: bool = False,
    ) -> None:
        if schedule.num_ranks != mesh.pp:
            raise LayoutError(f"schedule {schedule.name} has {schedule.num_ranks} ranks but pp = {mesh.pp}")
        schedule = _runnable(schedule, mesh, step_reduces_gradients=step_reduces_gradients, validate=validate)
        self.schedule = schedule
        self.mesh = mesh
        self.device = torch.device(device) if device is not None else mesh.device
        self.pp_rank = mesh.pp_rank
        self.actions = schedule.actions[self.pp_rank]
        mine = set(schedule.stages_of(self.pp_rank))
        if set(stages) != mine:
            raise LayoutError(
                f"pp rank {self.pp_rank} holds stages {sorted(mine)} in {schedule.name} "
                f"but was given modules for {sorted(stages)}"
            )
        self.stages = dict(stages)
        self.last_stage = schedule.num_stages - 1
        self.loss_fn = loss_fn
        self.loss_stage = self.last_stage if loss_stage is None else loss_stage
        hooks: dict[int, OutputHook] = {}
        if loss_fn is not None and self.loss_stage in self.stages:
            hooks[self.loss_stage] = loss_hook(loss_fn)
        self.output_hooks = {**hooks, **(output_hooks or {})}
        self.step_fn = step_fn
        self.tensor_specs = dict(tensor_specs or {})
        self.groups = dict(groups or {})
        self._install_handlers(handlers, handler_wrappers)
        self.collective_timeout_s = collective_timeout_s
        self.wgrad = {s: WeightGradStore() for s in self.stages}
        self.deferrable = {s: deferrable_layers(mod) for s, mod in self.stages.items()}
        self._shapes = _spec_map(boundary_shape, schedule.num_stages)
        self._dtypes = _spec_map(dtype, schedule.num_stages)
        self.recv_window = recv_window
        self.record = record
        self.last_spans: list[Span] = []
        self.iteration = 0
        self._open_channels(recv_timeout_s, recv_depth, scatter_gather)
        self._eval: tuple[tuple[Action, ...], PipeComm] | None = None

    def _install_handlers(
        self, handlers: Mapping[str, Handler] | None, handler_wrappers: Sequence[HandlerWrapper]
    ) -> None:
        """The handler of every kind (core, point-to-point from the kinds' metadata, then the caller's),
        wrapped by ``handler_wrappers``; refuses a schedule with a kind nobody handles."""
        kinds = self.schedule.kinds
        self.recv_kinds = kinds.of_role("recv")
        self.fwd_recv = next((k.name for k in kinds.attached_to(F) if k.p2p.role == "recv"), None)
        self.bwd_recv = next((k.name for k in kinds.attached_to(I) if k.p2p.role == "recv"), None)
        self.send_sources = {
            name: CORE_TENSORS.get(spec.p2p.tensor, _from_outbox)
            for name, spec in kinds.items()
            if spec.p2p is not None and spec.p2p.role == "send"
        }
        self.handlers: dict[str, Handler] = {
            **default_handlers(),
            **_p2p_handlers(self.schedule),
            **(handlers or {}),
        }
        missing = {a.kind for a in self.actions} - set(self.handlers)
        if missing:
            raise DistributedError(f"no runtime handler for action kind(s) {', '.join(sorted(missing))}")
        self.handler_wrappers: list[HandlerWrapper] = []
        for wrapper in handler_wrappers:
            self.wrap_handlers(wrapper)

    def _open_channels(self, recv_timeout_s: float, recv_depth: int | None, scatter_gather: bool) -> None:
        """Collective: open the schedule's point-to-point channels and this rank's communicator (receive
        depth defaulted as the class docstring says)."""
        schedule = self.schedule
        self.mesh.open_channels(channel_pairs(schedule))
        if recv_depth is None and (self.device.type == "cuda" or nccl_rules.active()):
            recv_depth = schedule.num_stages
        self.recv_depth = recv_depth
        self.comm = PipeComm(
            schedule,
            self.mesh,
            self._recv_spec,
            timeout_s=recv_timeout_s,
            scatter_gather=scatter_gather,
            depth=self.recv_depth,
        )

    def wrap_handlers(self, wrapper: HandlerWrapper) -> None:
        """Register ``wrapper``: each kind's handler h becomes ``wrapper(kind, h)``. A wrapper registered
        later wraps the earlier ones (it runs first). Code that must see every action — whatever kind,
        whoever provides its handler — plugs in here without editing this class."""
        self.handlers = {kind: wrapper(kind, h) for kind, h in self.handlers.items()}
        self.handler_wrappers.append(wrapper)

    def where(self) -> str:
        """This rank, for messages: ``rank R (pp P[, dp D][, ep E][, tp T][, cp C])``."""
        return mesh_rank_label(self.mesh.layout, self.mesh.rank)

    def bounded(self, work: Any, what: str) -> None:
        """Wait for an asynchronous collective at most ``collective_timeout_s``; CollectiveTimeout else."""
        if not wait_work(work, self.collective_timeout_s, self.device):
            raise CollectiveTimeout(
                f"{self.where()}: {what} did not complete within {self.collective_timeout_s:g} s"
            )

    def global_loss(self, losses: list[float]) -> float:
        """Collective over all ranks: the iteration's mean loss over every microbatch of every dp
        replica (pass each rank's :meth:`run` result; ranks without the last stage pass [])."""
        total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64, device=self.device)
        for dim in ("pp", "dp"):
            work = dist.all_reduce(total, group=self.mesh.group(dim), async_op=True)
            self.bounded(work, f"the loss all-reduce over {dim}")
        return (total[0] / total[1]).item()

    def group(self, name: str) -> Any:
        """The process group a collective of group ``name`` runs over (dp, pp, tp or a named one)."""
        mesh_groups = {"dp": self.mesh.dp_group, "pp": self.mesh.pp_group, "tp": self.mesh.tp_group}
        if name in mesh_groups:
            return mesh_groups[name]
        try:
            return self.groups[name]
        except KeyError:
            raise DistributedError(f"no process group named {name!r}; pass it in groups=") from None

    def _recv_spec(self, a: Action) -> TensorSpec:
        tensor = self.schedule.kinds[a.kind].p2p.tensor
        if tensor in CORE_TENSORS:
            # the tensor at the boundary between the two stages = the later stage's input (or its grad)
            s = max(a.stage, peer_stage(a, self.schedule))
            return tuple(self._shapes[s]), self._dtypes[s]
        try:
            return self.tensor_specs[tensor](a)
        except KeyError:
            raise DistributedError(f"{a}: no tensor spec for {tensor!r}; pass it in tensor_specs=") from None

    def device_sync(self) -> None:
        """A device-wide synchronize: ``torch.cuda.synchronize`` on CUDA; under NCCL's rules over gloo
        (:mod:`pipewright.runtime.setup.nccl_rules`) a wait for every posted operation; nothing on the CPU.
        Called at most once per step (to read the step's CUDA event timings)."""
        nccl_rules.device_synchronize(self.device, self.comm.timeout_s)

    def run(
        self, inputs: list[torch.Tensor] | None = None, targets: list[torch.Tensor] | None = None
    ) -> list[float]:
        """Run one iteration. ``inputs``/``targets``: the m microbatches (needed only on the ranks
        holding the first/last stage). Gradients accumulate into ``.grad`` (zero them between
        iterations). Returns the per-microbatch losses (unscaled) on the last stage's rank, else []."""
        state = RunState(self, inputs, targets, self.actions, self.comm)
        self.last_spans = self._execute(state, record=self.record)
        for s, store in self.wgrad.items():
            if len(store):
                log.warning("stage %d: %d deferred weight gradients never flushed (no W)", s, len(store))
                store.flush()
        self.iteration += 1
        return _loss_values(state.losses)

    def evaluate(
        self, inputs: list[torch.Tensor] | None = None, targets: list[torch.Tensor] | None = None
    ) -> list[float]:
        """Forward only, without gradients: the schedule's F/SEND_F/RECV_F actions in their order
        (a valid schedule stays deadlock-free without its backward actions). Same arguments and
        result as :meth:`run`; no spans are recorded and ``.grad`` is untouched."""
        if self._eval is None:
            kinds = {F} | {k.name for k in self.schedule.kinds.attached_to(F)}
            sched = self.schedule.with_actions(
                [[a for a in row if a.kind in kinds] for row in self.schedule.actions]
            )
            self._eval = (
                sched.actions[self.pp_rank],
                PipeComm(
                    sched,
                    self.mesh,
                    self._recv_spec,
                    timeout_s=self.comm.timeout_s,
                    scatter_gather=self.comm.scatter_gather,
                    depth=self.recv_depth,
                ),
            )
        actions, comm = self._eval
        state = RunState(self, inputs, targets, actions, comm)
        with torch.no_grad():
            self._execute(state, record=False)
        return _loss_values(state.losses)

    def _execute(self, state: RunState, *, record: bool) -> list[Span]:
        """Run ``state.actions`` in order; receives posted ahead (``recv_depth`` per channel, or
        ``recv_window`` actions)."""
        actions, comm = state.actions, state.comm
        comm.reset()
        clock = ActionClock(self.device) if record else None
        if clock is not None:
            barrier = dist.barrier(group=self.mesh.pp_group, async_op=True)
            self.bounded(barrier, "the pp barrier before the step")
            clock.start()
        window, handlers = self.recv_window, self.handlers
        if window is None:
            comm.prime()
        for pos, a in enumerate(actions):
            state.position = pos
            if window is not None:
                comm.post([b for b in actions[pos : pos + window + 1] if b.kind in self.recv_kinds])
            if clock is not None:
                clock.mark()
            try:
                handlers[a.kind](state, a)
            except DistributedError:
                raise
            except Exception as e:
                if is_timeout(e):  # a feature's collective (bounded by its group's timeout), a send
                    raise CollectiveTimeout(
                        f"{self.where()}, position {pos}, action {a}: timed out ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0]})"
                    ) from e
                raise ActionError(
                    f"rank {self.mesh.rank} (pp {self.pp_rank}), position {pos}, action {a} "
                    f"({self.schedule.name}): {type(e).__name__}: {e}"
                ) from e
            if clock is not None:
                clock.mark()
        for stage in list(state.reductions):
            finish_reduction(state, stage)
        comm.finish()
        state.waits.check(self.device)  # CUDA: the reductions' deadlines (the stream waited on them)
        if clock is None:
            return []
        if self.device.type == "cuda" or nccl_rules.active():
            self.device_sync()  # the step's one synchronize: its CUDA events are complete after it
        kinds = self.schedule.kinds
        return [
            Span(self.pp_rank, a, start, end, "compute" if kinds[a.kind].compute else "comm", self.iteration)
            for a, (start, end) in zip(actions, clock.intervals(), strict=True)
        ]
