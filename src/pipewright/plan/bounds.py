"""The search's cheap tests before a candidate is mapped: a lower bound on its estimate
(:func:`lower_bound`, the order candidates are taken in and the pruning stop) and whether any
partition can fit memory (:func:`may_fit`). Both read :func:`bound_cost`: the candidate's pieces on
the fastest device kind with free communication, and with the static bytes the full simulation
prices (the optimizer sharding over dp × cp, the gradient buffer's dtype), so a layout that fits only
with ZeRO-1 is not dropped here."""

from __future__ import annotations

from dataclasses import replace

from pipewright.hardware import accelerator
from pipewright.plan import grouping
from pipewright.plan.costs import StageCost, stage_cost
from pipewright.plan.partition import fits_somewhere, stage_terms
from pipewright.plan.problem import Candidate
from pipewright.plan.search_context import _Context, parts_of


def bound_cost(ctx: _Context, c: Candidate) -> StageCost:
    """The pieces of ``c`` on the fastest device kind, its tensor-parallel all-reduces over the closest
    group (:func:`_closest_group`) and no ring or boundary transfers: every stage of every mapping
    costs at least this, and needs the same bytes (memory does not depend on the devices' links).
    Cached per cost-model choice."""
    prob = ctx.problem
    key = (c.microbatch, c.tp, c.recompute, c.sequence_parallel, c.cp, c.sharding, c.ep)
    if c.sharding != "none":  # the sharded state depends on dp (and pipelined FSDP on pp)
        key += (c.dp, c.pp)
    hit = ctx.bound_cache.get(key)
    if hit is not None:
        return hit
    if prob.profile is not None:
        hit = prob.profile.stage_cost(c.microbatch)
    else:
        pc = parts_of(prob, c)
        state = pc.state(c.dp, c.pp)  # the static bytes the simulation prices (optimizer sharding)
        tp = _closest_group(ctx, c.tp)
        for kind in prob.device_kinds():
            eff = prob.efficiency_for(kind)
            sc = stage_cost(pc, accelerator(kind), prob.dtype, eff, tp, state=state)
            if hit is None or sc.time(prob.spec.layers, True, True) < hit.time(prob.spec.layers, True, True):
                hit = sc
    ctx.bound_cache[key] = hit
    return hit


def _closest_group(ctx: _Context, size: int):
    """The tensor-parallel all-reduce time over the first ``size`` devices of the cluster's order: one
    node's NVLink on clusters of like nodes, where no group of that size is faster (on a hand-written
    topology whose fastest links are elsewhere this is a heuristic, not a bound); free on clusters of
    mixed kinds."""
    if size <= 1 or len(ctx.kinds) > 1:
        return lambda n: 0.0
    return ctx.all_reduce(tuple(ctx.order[:size]))


def lower_bound(ctx: _Context, c: Candidate) -> float:
    """A bound no estimate of ``c`` goes under: with W the work of all layers, the embedding and the
    head on the fastest device kind with free communication, Σ_r t_r ≥ W and t_max ≥ W/p, so the
    estimate is at least W/p·(m − 1 + p) for one chunk per rank without W passes (1F1B) and
    W/p·(m − 1 + 1/v) for zero-bubble and V-shaped orders (ZB-V, DualPipeV: their bubble can be
    under (p − 1)/v); interleaved 1F1B's order (:mod:`pipewright.plan.chunked`) takes
    at least W/p·(m + (p − 1)/v), what it takes with equal chunks (Narayanan et al. 2021)."""
    cost = bound_cost(ctx, c)
    weights = cost.layer_weights(ctx.problem.spec)
    layers = ctx.problem.spec.layers if weights is None else sum(weights)
    work = cost.time(0, True, True) + layers * cost.layer
    p, m, v = c.pp, c.microbatches, c.virtual
    if v > 1 and grouping.grouped(c.schedule):  # Megatron's interleaved order
        return work / p * (m + (p - 1) / v)
    # one chunk per rank without W passes (1F1B, GPipe): a microbatch's pass through every rank;
    # otherwise (zero-bubble, V shapes) no more than a rank's own work, m·W/p, is certain
    tail = p if v == 1 and not c.schedule.startswith("zb") else 1 / v
    return work / p * (m - 1 + tail)


def may_fit(ctx: _Context, c: Candidate) -> bool:
    """False when no partition of ``c`` fits even with every device as large as the largest (or
    ``--memory-limit``): a necessary condition checked before any device is mapped or link priced."""
    prob = ctx.problem
    if prob.memory_limit is not None:
        limit = prob.memory_limit
    else:
        limit = max(accelerator(kind).memory_bytes for kind in prob.device_kinds())
    p, v = c.pp, c.virtual
    if p * v > prob.spec.layers:
        return False
    in_flight = grouping.in_flight(c.schedule, p, c.microbatches, v, prob.microbatch_group)
    cost = bound_cost(ctx, c)
    if cost.layer_weights(prob.spec) is not None:
        return True  # unlike layers: the partition itself decides
    # the embedding's and the head's activations are left out: how many of them a schedule holds at
    # its peak depends on the order (zero-bubble and interleaved orders free the head's before the
    # peak), so with them the bound could exceed the simulated peak
    cost = replace(cost, embed_act=0.0, head_act=0.0)
    return fits_somewhere(stage_terms([cost] * p, [0.0] * p, in_flight, [limit] * p), prob.spec.layers, v)
