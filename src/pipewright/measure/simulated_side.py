"""``simulate``'s report of the layout a prepared run uses, per pipeline rank, in the terms of a measured
rank (:class:`~pipewright.measure.rank.RankMeasure`): peak memory and its parts, FLOPs per action kind
(one device's share, as the measured rank's), and the bytes of one boundary message.

The setup is :func:`pipewright.plan.setup.model_setup` (what ``pipewright simulate --model`` builds) on
``nodes × 8`` H100s: the run's model, tp/pp/dp/cp/ep, schedule, microbatch size, dtype, recomputation,
sequence parallelism, ZeRO-1 and layout, and the runtime's gradients: ``.grad`` in the compute dtype
(``grad_dtype``; Megatron's default is an fp32 gradient buffer, 2 bytes a parameter more), each stage's
output kept until its backward (``stage_outputs="kept"``, ``RunState.stage_outputs``) and PyTorch's
non-reentrant checkpoint, which does not re-run a layer's last GEMM (``checkpoint``). Prices (seconds)
do not enter what is compared."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipewright.ir import REDUCE_GRAD, SEND_F, Action

if TYPE_CHECKING:
    from pipewright.features.kfac.rank_memory import KfacRank

#: the runtime's precision names → the cost model's dtypes
_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class RankPrediction:
    """The simulator's view of one pipeline rank (bytes, FLOPs)."""

    pp_rank: int
    peak_bytes: float
    parts: dict[str, float]
    flops: dict[str, float]
    message_bytes: float
    memory_limit: float | None = None  # one GPU's memory (bytes)
    reduce_bytes: float = 0.0  # over dp: the gradient reduction's messages (REDUCE_GRAD), the step's scalars
    plan: object = None  # what the measured program follows (K-FAC's bubbles: .kfac_side)
    #: tp/cp/ep collectives' buffer bytes of the step (:func:`.collective_bytes.simulated`)
    collective_bytes: dict[str, float] = field(default_factory=dict)


def sim_setup(run, gpu: str = "h100-sxm"):
    """The :class:`~pipewright.plan.setup.SimSetup` of ``run``'s layout on whole 8-GPU nodes of ``gpu``."""
    from pipewright.mesh import DEFAULT_ORDER, Mesh
    from pipewright.plan.setup import cluster_topology, model_setup

    c = run.config
    world = c.world_size
    per_node = min(8, world)
    topo, acc = cluster_topology(gpu, max(1, world // per_node), per_node)
    order = DEFAULT_ORDER if c.cp == 1 else "tp-cp-dp-pp"
    mesh = Mesh(c.tp, c.pp, c.dp, order, cp=c.cp, ep=c.ep)
    setup = model_setup(
        run.spec,
        topo,
        mesh,
        run.schedule,
        c.microbatch_size,
        gpu=acc,
        dtype=_DTYPE[c.precision],
        recompute=c.recompute,
        sequence_parallel=c.sequence_parallel,
        layout=run.layout,
        optimizer_sharding="zero1" if c.shard_optimizer else "none",
        grad_dtype=_DTYPE[c.precision],
        stage_outputs="kept",
        checkpoint="non-reentrant",
        cp_comm="pipewright",  # the runtime's ring (runtime/parallel/cp/ring.py): fp32 dK/dV
    )
    from pipewright.features.vocab.options import VocabOptions
    from pipewright.options import section_of

    return _with_vocab_parallel(setup, section_of(c, VocabOptions).parallel)


def _with_vocab_parallel(setup, option: str):
    """The setup with the vocabulary layers split as ``--vocab-parallel`` splits them (the feature's
    own pricing, as ``simulate --vocab-parallel`` applies it); unchanged for ``none``."""
    if option == "none":
        return setup
    from dataclasses import replace

    from pipewright.features.vocab.simulate import apply_to_simulation

    sched, cost, comm = apply_to_simulation(option, setup.schedule, setup.cost, setup.comm)
    return replace(setup, schedule=sched, cost=cost, comm=comm)


def predict(run) -> list[RankPrediction]:
    """Per pipeline rank: the simulated peak memory with its parts, FLOPs per kind, message bytes."""
    from pipewright.cost.memory_parts import rank_memory_parts
    from pipewright.cost.sharding import reduction_parts, step_scalar_bytes
    from pipewright.measure.collective_bytes import simulated
    from pipewright.measure.kfac_side import kfac_ranks

    setup = sim_setup(run)
    result = setup.simulate()
    sched, cost = result.source, setup.cost
    peaks = [float(p) for p in result.peak_memory]
    kfac = kfac_ranks(run, setup)
    for rank, k in kfac.items():  # the activations' peak with K-FAC's kept tensors
        peaks[rank] = float(cost.static_bytes(rank, sched)) + k.activations
    parts = rank_memory_parts(cost, sched, peaks) or [_lumped(cost, sched, r, p) for r, p in enumerate(peaks)]
    message = float(cost.message_bytes(Action(0, SEND_F, 0), sched)) if sched.num_stages > 1 else 0.0
    out = []
    held = _weight_versions(run, cost, sched)
    for rank, peak in enumerate(peaks):
        k = kfac.get(rank)
        peak = (
            _with_step(cost, sched, rank, peak, parts[rank])
            if k is None
            else _with_kfac(cost, sched, rank, k, parts[rank])
        )
        if held.get(rank):
            parts[rank]["weight_versions"] = held[rank]
            peak += held[rank] - _gradients_stepped(cost, parts[rank])
        _settle(parts[rank])
        flops: dict[str, float] = defaultdict(float)
        for action in sched.actions[rank]:
            f = float(cost.flops(action, sched))
            if f:
                flops[action.kind] += f
        if k is not None:
            flops.update(k.flops)
        mine = sched.actions[rank]
        reduce = sum(  # the collectives a reduction is made of (ZeRO-1: reduce-scatter + all-gather)
            _moved(b, run.config)
            for a in mine
            if a.kind == REDUCE_GRAD
            for _, b in reduction_parts("all_reduce", cost.message_bytes(a, sched))
        ) + step_scalar_bytes(run.config.dp, run.config.shard_optimizer or run.config.ep > 1, run.config.cp)
        plan = k.plan if k is not None else None
        collectives = simulated(cost, sched, rank)
        out.append(
            RankPrediction(
                rank, peak, parts[rank], dict(flops), message, setup.memory_limit, reduce, plan, collectives
            )
        )
    return out


def _moved(nbytes: float, config) -> float:
    """The bytes of a reduction that cross devices: a mixture of experts' routed-expert share
    (``GradBytes.expert``) is reduced over the dp·cp/ep replicas of each expert, none when that is
    one (ep = dp·cp: each expert on one device of the stage)."""
    expert = getattr(nbytes, "expert", 0.0)
    alone = config.dp * config.cp // max(config.ep, 1) == 1
    return float(nbytes) - (expert if alone else 0.0)


def _lumped(cost, sched, rank: int, peak: float) -> dict[str, float]:
    """Parts of a cost model that wraps the transformer's (vocabulary parallelism): its static bytes as
    one ``state`` and the rest of the peak as activations."""
    static = float(cost.static_bytes(rank, sched))
    return {"state": static, "activations": peak - static}


def _settle(parts: dict[str, float]) -> None:
    """``parts`` with ``total`` their sum and, where they have one, the allocator's reserve
    :data:`~pipewright.cost.memory_parts.ALLOCATOR_RESERVE` of the rest (as
    :func:`~pipewright.cost.memory_parts.memory_parts` sets both), after the step's split, K-FAC's state or
    an asynchronous policy's weight versions changed them. ``total`` is then the reported peak + the
    reserve + the boundary's send and receive buffers (in ``communication_buffers``; none at the
    optimizer step), the two the simulated peak does not count."""
    from pipewright.cost.memory_parts import ALLOCATOR_RESERVE

    parts.pop("total", None)
    if "allocator_reserve" in parts:
        parts["allocator_reserve"] = 0.0
        parts["allocator_reserve"] = ALLOCATOR_RESERVE * sum(parts.values())
    parts["total"] = sum(parts.values())


def _with_step(cost, sched, rank: int, peak: float, parts: dict[str, float]) -> float:
    """The higher of ``peak`` and the optimizer step's: the static bytes + the step's fp32 gradient
    copies (:func:`~pipewright.cost.chunk_memory.step_transient_bytes`; the simulated schedule has a
    STEP only where the optimizer is priced). When the step's is higher, ``parts`` becomes the step's
    (:func:`_step_parts`)."""
    from pipewright.cost.chunk_memory import step_transient_bytes

    base = getattr(cost, "inner", cost)  # a vocabulary-parallel cost wraps the transformer's
    static = float(cost.static_bytes(rank, sched))
    stepping = step_transient_bytes(base.cost_inputs, base.rank_parameters(rank, sched))
    if static + stepping <= peak:
        return peak
    _step_parts(parts, 0.0, stepping)
    return static + stepping


def _with_kfac(cost, sched, rank: int, k: KfacRank, parts: dict[str, float]) -> float:
    """A K-FAC rank's peak, :meth:`KfacRank.peak <pipewright.features.kfac.rank_memory.KfacRank.peak>`
    over the rank's static bytes (what ``simulate --fill kfac`` reports), with its factors and inverses
    as ``kfac_state``; where the step's is the higher, ``parts`` becomes the step's (``activations``
    the bytes K-FAC still holds, ``step_gradients`` the fp32 copies and the KL-clip)."""
    parts["kfac_state"] = k.state
    if k.peaks_at_step:
        _step_parts(parts, k.held, k.step_transient + k.step)
    return k.peak(float(cost.static_bytes(rank, sched)))


def _step_parts(parts: dict[str, float], held: float, stepping: float) -> None:
    """``parts`` as the optimizer step's: no activations but the ``held`` bytes still live after the
    iteration, nothing recomputed or in flight, and ``stepping`` as ``step_gradients``."""
    for key in ("recompute_transient", "communication_buffers"):
        parts[key] = 0.0
    parts["activations"] = held
    parts["step_gradients"] = stepping


def _weight_versions(run, cost, sched) -> dict[int, float]:
    """Per pipeline rank, the bytes an asynchronous policy holds beyond the live weights: the weight
    versions in flight and its extra gradient buffers (``features.async_weights.weight_memory``, which
    the schedule's memory timeline does not include), held the whole step; {} for other schedules."""
    from pipewright.features.async_weights.options import AsyncOptions
    from pipewright.options import section_of

    policy = section_of(run.config, AsyncOptions).weight_policy
    if not policy or policy == "none" or sched.meta.get("flush", True):
        return {}
    from pipewright.cost.chunk_memory import weight_element_bytes
    from pipewright.features.async_weights.weight_memory import weight_bytes

    size = weight_element_bytes(cost.cost_inputs)
    params = {s: float(cost._chunk(s, sched).params) * size for s in range(sched.num_stages)}
    total = weight_bytes(policy, sched, params)
    out: dict[int, float] = defaultdict(float)
    for stage, held in total.items():
        out[sched.rank_of(stage)] += held - params[stage]
    return dict(out)


def _gradients_stepped(cost, parts: dict[str, float]) -> float:
    """The gradient buffer an asynchronous schedule does not hold: each microbatch's ``STEP`` consumes
    its gradients and frees them (``.grad`` set to None), so a gradient lives from its parameter's
    backward to that step, not the whole step as the schedule's static memory keeps it. ``parts``
    loses them (the embedding and output layer's share too); returns their bytes."""
    state = cost.state()
    edges = parts.get("embedding_output_layer", 0.0) * state.gradients / state.total
    freed = parts.get("gradients", 0.0) + edges
    parts["gradients"] = 0.0
    parts["embedding_output_layer"] = parts.get("embedding_output_layer", 0.0) - edges
    return freed
