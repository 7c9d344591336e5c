"""``simulate``'s report of the layout a prepared run uses, per pipeline rank, in the terms of a measured
rank (:class:`~pipewright.measure.rank.RankMeasure`): peak memory and its parts, FLOPs per action kind
(one device's share, as the measured rank's), and the bytes of one boundary message.

The setup is :func:`pipewright.plan.setup.model_setup` (what ``pipewright simulate --model`` builds) on
``nodes × 8`` H100s: the run's model, tp/pp/dp/cp/ep, schedule, microbatch size, dtype, recomputation,
sequence parallelism, ZeRO-1 and layout. Prices (seconds) do not enter what is compared."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipewright.ir import REDUCE_GRAD, SEND_F, Action

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
    reduce_bytes: float = 0.0  # the data-parallel gradient reduction's messages (REDUCE_GRAD)


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
    return model_setup(
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
    )


def predict(run) -> list[RankPrediction]:
    """Per pipeline rank: the simulated peak memory with its parts, FLOPs per kind, message bytes."""
    from pipewright.cost.memory_parts import rank_memory_parts

    setup = sim_setup(run)
    result = setup.simulate()
    sched, cost = result.source, setup.cost
    parts = rank_memory_parts(cost, sched, list(result.peak_memory)) or [{} for _ in result.peak_memory]
    message = float(cost.message_bytes(Action(0, SEND_F, 0), sched)) if sched.num_stages > 1 else 0.0
    out = []
    for rank, peak in enumerate(result.peak_memory):
        flops: dict[str, float] = defaultdict(float)
        for action in sched.actions[rank]:
            f = float(cost.flops(action, sched))
            if f:
                flops[action.kind] += f
        mine = sched.actions[rank]
        reduce = sum(float(cost.message_bytes(a, sched)) for a in mine if a.kind == REDUCE_GRAD)
        out.append(
            RankPrediction(rank, float(peak), parts[rank], dict(flops), message, setup.memory_limit, reduce)
        )
    return out
