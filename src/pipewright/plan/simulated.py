"""Simulating one evaluated plan in full: its cost model (recomputation, layout and a Mesh placement of
its devices) and the generator's schedule, lowered once per shape and not validated (the generators'
schedules are trusted)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipewright.cost.comm import Mesh
from pipewright.cost.recompute import make_cost
from pipewright.plan.mapping import placement
from pipewright.plan.problem import Evaluated, Problem


def device_memory_limit(prob: Problem, devices: Sequence[str]) -> float:
    """Bytes each of ``devices`` may use: ``--memory-limit``, else the smallest device memory."""
    if prob.memory_limit is not None:
        return prob.memory_limit
    return min(prob.topology.accelerator(d).memory_bytes for d in devices)


@functools.lru_cache(maxsize=16)
def _lowered(name: str, p: int, m: int, v: int, reduce: bool, group: int | None = None):
    """A generator's schedule (microbatch group ``group`` where it groups: :mod:`pipewright.plan.grouping`),
    with the gradient all-reduce when ``reduce``, lowered: built once for all the layouts and mappings
    of one shape that the refinement simulates."""
    from pipewright.passes.grad_reduce import add_grad_reduction
    from pipewright.passes.lower import lower
    from pipewright.plan.grouping import build

    sched = build(name, p, m, v, group)
    return lower(add_grad_reduction(sched) if reduce else sched)


def rank_device(ev: Evaluated, rank: int) -> str:
    """The device of pipeline rank ``rank``'s (tp 0, dp 0) process — the one the simulator prices — in
    the mesh order tp-dp-pp of ``ev.devices``."""
    c = ev.candidate
    return ev.devices[rank * c.block * c.dp]


def plan_models(prob: Problem, ev: Evaluated):
    """(cost model, comm model) of one evaluated plan: its recomputation (per stage where chosen),
    degrees, layout and device placement (:func:`pipewright.plan.mapping.placement`, a Mesh placement);
    from the profile's measurements when the problem has one (:mod:`pipewright.plan.profile_input`)."""
    c = ev.candidate
    place = placement(prob.topology, ev.devices)
    extra = {"cp": c.cp, "ep": c.ep} if c.cp > 1 or c.ep > 1 else {}
    mesh = Mesh(c.tp, c.pp, c.dp, placement=place, **extra)
    if prob.profile is not None:
        from pipewright.cost.comm import TopologyComm
        from pipewright.cost.profiled import ProfiledComm

        cost = prob.profile.cost(c.microbatch, ev.chunk_layers)
        comm = TopologyComm(prob.topology, mesh, prob.efficiency_for().comm)
        return cost, ProfiledComm.from_cost(cost, comm)
    gpu = prob.topology.nodes[ev.devices[0]].accelerator
    full = c.recompute == "full" or "full" in (ev.recompute_per_stage or ())
    cost = make_cost(
        c.recompute,
        per_stage=ev.recompute_per_stage,
        **(partial_fields(prob, ev.chunk_layers) if full else {}),
        spec=prob.spec_for(c.tp),
        microbatch=c.microbatch,
        gpu=gpu,
        dtype=prob.dtype,
        mesh=mesh,
        sequence_parallel=c.sequence_parallel,
        topology=prob.topology,
        efficiency=prob.efficiency_for(gpu),
        layout=ev.chunk_layers,
        **prob.options(c).kwargs(),
    )
    return cost, cost.comm


def partial_fields(prob: Problem, chunk_layers) -> dict[str, object]:
    """``--recompute-method``/``--recompute-num-layers`` for a plan with these layers per chunk: N at most
    the largest chunk's layers (Megatron-LM recomputes a whole chunk when N exceeds its layers, so a
    larger N prices the same; {} without the options)."""
    fields = dict(prob.recompute_partial)
    if fields and chunk_layers:
        fields["recompute_num_layers"] = min(int(fields.get("recompute_num_layers") or 1), max(chunk_layers))
    return fields


def simulate_plan(prob: Problem, ev: Evaluated) -> Evaluated:
    """Run the full simulator on one evaluated candidate (no validation) and fill in its time/memory;
    a schedule's overlapped F&B pairs priced as ``pipewright simulate`` prices them
    (:func:`pipewright.sim.pair_overlap.with_pair_overlap`)."""
    from pipewright.passes.grad_reduce import add_grad_reduction, append_optimizer_step
    from pipewright.sim import simulate
    from pipewright.sim.pair_overlap import with_pair_overlap

    c = ev.candidate
    if ev.schedule is not None:
        sched = ev.schedule
        if c.dp * c.cp > 1:  # the gradients over dp × cp, as model_setup adds them
            sched = add_grad_reduction(sched)
    else:
        group = prob.microbatch_group
        sched = _lowered(c.schedule, c.pp, c.microbatches, c.virtual, c.dp * c.cp > 1, group)
    if prob.efficiency_for(prob.topology.nodes[ev.devices[0]].accelerator).optimizer_bytes > 0:
        sched = append_optimizer_step(sched)  # as model_setup adds it
    cost, comm = plan_models(prob, ev)
    cost = with_pair_overlap(cost, sched)  # as ``pipewright simulate`` prices the schedule's F&B pairs
    shared = None
    if prob.cores is not None:
        from pipewright.sim.sharing import SharedCompute

        meta = {} if prob.profile is None else prob.profile.meta  # its contention curve, if measured
        shared = SharedCompute.from_profile(c.pp, prob.cores, meta, processes_per_rank=c.block * c.dp)
    result = simulate(sched, cost, comm=comm, shared=shared)
    ev.simulated = result.iteration_time
    ev.simulated_memory = max(result.peak_memory)
    limits = [device_memory_limit(prob, [rank_device(ev, r)]) for r in range(c.pp)]
    ev.fits = all(m <= lim for m, lim in zip(result.peak_memory, limits, strict=True))
    return ev
