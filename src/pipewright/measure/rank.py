"""One rank's real program, measured: the :class:`~pipewright.runtime.core.trainer.Trainer` of a prepared run
built at full size on meta tensors and the fake process group (:mod:`.fake`) and one training step run
through the real executor with its real schedule, under a :class:`~.tracker.ProgramTracker`.

The optimizer's state is created before the measured step (one optimizer step on zero gradients), so
the step measured is a steady one: parameters, optimizer state and gradients as every later step holds
them. Which ranks are measured: :func:`distinct_ranks` — one per pipeline rank (dp, tp, cp and ep
ranks of one pipeline rank hold the same stage shapes and run the same actions)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipewright.ir import W
from pipewright.measure.fake import META, fake_process_group, meta_world
from pipewright.measure.ring_flops import counted_in_convention
from pipewright.measure.tracker import CATEGORIES, ProgramTracker


@dataclass(frozen=True)
class RankMeasure:
    """What one rank's step did. ``peak_parts``: live bytes per category at the peak (their sum is
    ``peak_bytes``); ``peak_action``: the action running when it was reached; ``flops``: per action
    kind (``step``: the optimizer step); ``comm``: bytes per (op, group); ``comm_by_kind``: bytes per
    (action kind, op); ``static``: bytes live before the step (params, optimizer state, buffers)."""

    rank: int
    pp_rank: int
    stages: tuple[int, ...]
    peak_bytes: int
    peak_parts: dict[str, int]
    peak_action: str
    flops: dict[str, int]
    comm: dict[tuple[str, str], int]
    comm_count: dict[tuple[str, str], int]
    comm_by_kind: dict[tuple[str, str], int]
    static: dict[str, int]
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())


def distinct_ranks(config) -> list[int]:
    """The global rank of (dp 0, tp 0, cp 0) of each pipeline rank: one rank per distinct program."""
    from pipewright.mesh import Mesh

    layout = Mesh(
        config.tp, config.pp, config.dp, placement=config.placement_ranks(), ep=config.ep, cp=config.cp
    )
    return [layout.device_index(layout.rank(tp=0, pp=p, dp=0, cp=0)) for p in range(config.pp)]


def _group_names(mesh) -> dict[str, str]:
    """A process group's name → its label in the byte counts; a group of one rank moves nothing
    (its collectives are counted as ``local``). The gradients' group under context parallelism
    (dp × cp, ``grad_group``) is ``dp``, as the simulator's REDUCE_GRAD."""
    import torch.distributed as dist

    names, groups = {}, []
    for dim in ("tp", "pp", "dp", "cp"):
        try:
            groups.append((mesh.group(dim), dim))
        except (KeyError, RuntimeError):
            continue
    groups += [(getattr(mesh, a, None), label) for a, label in _NAMED]
    for group, label in groups:
        if group is not None:
            names[group.group_name] = label if dist.get_world_size(group) > 1 else "local"
    return names


#: the mesh's other groups (attribute, label); the gradient groups last, so a group that is both is ``dp``
_NAMED = (
    ("ep_group", "ep"),
    ("ep_back_group", "ep"),
    ("expert_dp_group", "expert-dp"),
    ("expert_grad_group", "expert-dp"),
    ("grad_group", "dp"),
)


def _channel_names(mesh) -> dict[str, str]:
    """The point-to-point channels' groups (opened by the executor) → ``pp``."""
    from pipewright.runtime.core.distributed_errors import LayoutError

    names = {}
    for src in range(mesh.pp):
        for dst in range(mesh.pp):
            try:
                group = mesh.channel(src, dst)
            except LayoutError:
                continue
            if group is not None:
                names[group.group_name] = "pp"
    return names


def _ring_names(trainer) -> dict[str, str]:
    """The context-parallel ring's backward group (a second group over the cp ranks, held by the
    trainer's ring) → ``cp``."""
    group = getattr(getattr(trainer.context, "ring", None), "back_group", None)
    return {group.group_name: "cp"} if group is not None else {}


def _tied_names(trainer) -> dict[str, str]:
    """A tied embedding's group of the first and the last stage's ranks (``TiedEmbeddings``) → ``tied``."""
    tied = getattr(getattr(trainer, "options", None), "tied", None)
    group = getattr(tied, "group", None)
    return {group.group_name: "tied"} if group is not None else {}


def _meta_batches(trainer, config, spec):
    """Token ids of the run's shapes (meta: no data), in place of the dataset's batch."""
    b, m = config.microbatch_size, config.microbatches
    seq = spec.seq_len // trainer.mesh.cp

    def batches(split: str, step: int):
        xs = [torch.zeros(b, seq, dtype=torch.long) for _ in range(m)]
        return xs, [torch.zeros(b, seq, dtype=torch.long) for _ in range(m)]

    return batches


def _base_optimizer(trainer) -> torch.optim.Optimizer:
    opt = trainer.master.optimizer if trainer.master is not None else trainer.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _fused_state(opt: torch.optim.Optimizer) -> None:
    """The state of a fused Adam(W)'s parameters made as its first step makes it (a float32 ``step``
    on the parameter's device, both moments ``zeros_like``). That first step checks that the device
    type has fused kernels, and PyTorch's list leaves out ``meta`` although ``_fused_adamw_`` runs
    there; with the state in place the steps measured run the real fused step, as on CUDA."""
    for group in opt.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def _warm_optimizer(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state: one step on zero gradients (the state every later step holds)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    _fused_state(opt)
    opt.step()
    for p in params:
        p.grad = None


def _label(action) -> str:
    return str(action)


def _wrap(tracker: ProgramTracker, after_w: Callable[[], None]):
    def wrapper(kind, handler):
        def run(state, action):
            tracker.action, tracker.kind = _label(action), kind
            try:
                return handler(state, action)
            finally:
                if kind == W:
                    after_w()
                tracker.action, tracker.kind = "between actions", "other"

        return run

    return wrapper


def _classify(tracker: ProgramTracker, trainer, opt: torch.optim.Optimizer) -> None:
    """After the build: parameters, buffers and optimizer state (masters included) in their categories."""
    mods = list(trainer.stages.values())
    tracker.move((p for m in mods for p in m.parameters()), "params")
    tracker.move(trainer.built.parameters.values(), "params")
    tracker.move((b for m in mods for b in m.buffers()), "buffers")
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    masters = [p for g in opt.param_groups for p in g["params"]]
    params = {id(p) for m in mods for p in m.parameters()}
    tracker.move((p for p in masters if id(p) not in params), "optimizer")
    tracker.move(state, "optimizer")


def _grad_hooks(tracker: ProgramTracker, trainer) -> list:
    """Count each parameter's ``.grad`` as ``grads`` once autograd has accumulated it."""

    def moved(param: torch.Tensor) -> None:
        if param.grad is not None:
            tracker.move([param.grad], "grads")

    params = (p for mod in trainer.stages.values() for p in mod.parameters() if p.requires_grad)
    return [p.register_post_accumulate_grad_hook(moved) for p in params]


def _w_grads(tracker: ProgramTracker, trainer) -> Callable[[], None]:
    """After a W: its weight gradients as ``grads`` (the W store sets or adds to ``.grad`` itself,
    which autograd's accumulation hook does not see)."""
    params = [p for mod in trainer.stages.values() for p in mod.parameters() if p.requires_grad]

    def sweep() -> None:
        tracker.move((p.grad for p in params if p.grad is not None), "grads")

    return sweep


def _p2p_as_on_cuda(executor, schedule) -> None:
    """Point-to-point as the executor runs it on CUDA, not as on a CPU process group: receives posted
    at most ``num_stages`` ahead per channel (its CUDA default ``recv_depth``; on CPU every receive of
    the step is posted, and its buffer allocated, at step start) and a send's buffer released once a
    later message from its peer proves it received (on CUDA completion is polled; the fake process
    group completes every op at once)."""
    executor.recv_depth = executor.comm.depth = schedule.num_stages
    executor.comm._release_received = True


def _follow(trainer, plan) -> None:
    """Give ``plan`` (the simulator's, :attr:`~.simulated_side.RankPrediction.plan`) to the plugins that
    follow one (``follow_plan``: K-FAC's bubbles run the planned tasks, not those that fit by the
    durations measured, which on meta tensors mean nothing)."""
    if plan is None:
        return
    for plugin in trainer.plugins:
        follow = getattr(plugin, "follow_plan", None)
        if follow is not None:
            follow(plan)


def measure_rank(run, rank: int, plan=None) -> RankMeasure:
    """Build ``rank``'s share of the prepared ``run`` at full size on meta tensors and measure one step
    (``plan``: what the simulator planned that the program follows, see :func:`_follow`)."""
    from pipewright.runtime.core.trainer import Trainer
    from pipewright.runtime.parallel.process_mesh import ParallelMesh

    c = run.config
    t0 = time.perf_counter()
    with fake_process_group(rank, c.world_size):
        mesh = ParallelMesh.build(
            dp=c.dp, pp=c.pp, tp=c.tp, placement=c.placement_ranks(), ep=c.ep, cp=c.cp, device="cpu"
        )
        mesh.device = META  # the trainer puts its stages and inputs on the mesh's device
        tracker = ProgramTracker(_group_names(mesh))
        with meta_world(), tracker, counted_in_convention(tracker):
            tracker.counting = False
            trainer = Trainer(run, mesh=mesh)
            trainer._batches = _meta_batches(trainer, c, run.spec)
            _p2p_as_on_cuda(trainer.executor, run.schedule)
            tracker.group_names |= _channel_names(mesh) | _ring_names(trainer) | _tied_names(trainer)
            opt = _base_optimizer(trainer)
            tracker.phase = "optimizer"
            _warm_optimizer(opt)
            _follow(trainer, plan)
            _classify(tracker, trainer, opt)
            hooks = _grad_hooks(tracker, trainer)
            trainer.executor.wrap_handlers(_wrap(tracker, _w_grads(tracker, trainer)))
            static = dict(tracker.totals)
            tracker.counting, tracker.phase, tracker.action = True, "activations", "step start"
            tracker.reset_peak()
            trainer.forward_backward(0)
            tracker.phase, tracker.action, tracker.kind = "optimizer", "optimizer step", "step"
            trainer.optimizer_step(0)
            for h in hooks:
                h.remove()
            trainer.guard.close()
    return RankMeasure(
        rank=rank,
        pp_rank=mesh.pp_rank,
        stages=tuple(run.schedule.stages_of(mesh.pp_rank)),
        peak_bytes=tracker.peak,
        peak_parts={k: tracker.peak_parts[k] for k in CATEGORIES},
        peak_action=tracker.peak_action,
        flops=dict(tracker.flops),
        comm=dict(tracker.comm),
        comm_count=dict(tracker.comm_count),
        comm_by_kind=dict(tracker.comm_by_kind),
        static={k: static[k] for k in CATEGORIES},
        seconds=time.perf_counter() - t0,
    )
