"""Search over (tp, pp, dp, v, microbatch size, recomputation, schedule, mapping style) with pruning.

For every candidate the planner (1) deals the devices (:mod:`pipewright.plan.mapping`), (2) prices each
pipeline rank on its slowest device and its tensor-parallel group (:mod:`pipewright.plan.costs`),
(3) partitions the layers to minimise the bottleneck rank under the schedule's memory
(:mod:`pipewright.plan.partition`) and (4) estimates the iteration time by pricing the schedule's own
order (:mod:`pipewright.plan.chunked`): each chunk's F, B, I and W seconds (its layers, the embedding
on the first chunk, the output layer and loss on the last) on the slowest device of its rank, one
boundary transfer per hop between ranks (the slowest link's), and with d > 1 each chunk's gradient
all-reduce after its last backward, one link per rank, exposed where it runs past the end. With
constant transfer times this is the simulator's makespan (``tests/test_plan_estimate.py``). Before
any device is mapped, a candidate whose layers fit no partition even on the largest device is dropped
(:func:`may_fit`), and candidates are taken in order of a cheap lower bound on the estimate
(:func:`lower_bound`), stopping once it exceeds the ``finalists``-th best estimate. Stage costs are
cached per group signature (size, ring bandwidth, latency), so a symmetric 16,384-device cluster prices
a handful of groups, and maps are dealt lazily (:class:`~pipewright.plan.mapping.DeviceMap`). The
``finalists`` best estimates (and the baselines) are then simulated in full (no validation: the
generators' schedules are trusted) and ranked by simulated time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pipewright.cost.layer import replicated_parameters
from pipewright.cost.sharding import GRAD_DTYPE_BYTES, like
from pipewright.errors import ConfigError, PipewrightError
from pipewright.hardware import accelerator
from pipewright.plan import grouping
from pipewright.plan.bounds import lower_bound, may_fit
from pipewright.plan.chunked import (
    chunked_time,
    end_chunks_in_flight,
    order_placement,
)
from pipewright.plan.costs import StageCost, stage_cost
from pipewright.plan.mapping import DeviceMap, device_order, map_devices, slowest_first
from pipewright.plan.partition import (
    DoesNotFitError,
    chunk_layout,
    fits_somewhere,
    partition,
    stage_terms,
)
from pipewright.plan.problem import (
    Candidate,
    Evaluated,
    Problem,
    lowered_actions,
    tp_splits,
    why_slower,
)
from pipewright.plan.refine import per_stage_recompute, refine
from pipewright.plan.search_context import _Context, messages, parts_of
from pipewright.plan.simulated import simulate_plan
from pipewright.plan.zb_limit import cost_aware_order
from pipewright.schedules.registry import info

#: Devices above which the finalists other than the best are not refined and zb-auto's memory-limit
#: search is skipped (each simulation there prices thousands of groups).
LARGE_MESH = 1024


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(problem: Problem, too_large: list[Candidate] | None = None) -> Iterable[Candidate]:
    """Every (t, p, d, b, schedule, v, recompute, style) the model, devices and batch allow, each one
    ``pipewright train`` accepts (:func:`~pipewright.plan.problem.tp_splits`, the schedule's rules).
    Layouts whose simulation would exceed ``problem.max_actions`` go to ``too_large`` instead."""
    spec, n = problem.spec, len(problem.topology.devices)
    measured = problem.profile
    for t, cp in itertools.product(_divisors(n), problem.cp_choices):
        if t > problem.max_tp or not tp_splits(spec, t) or n % (t * cp):
            continue
        if measured is not None and t != measured.tp:  # a profile prices only its own tp
            continue
        for p in _divisors(n // (t * cp)):
            if p > spec.layers:
                continue
            d = n // (t * cp * p)
            if any(f is not None and f != x for f, x in zip(problem.fixed, (t, p, d), strict=True)):
                continue
            for b in problem.microbatch_sizes:
                if problem.global_batch % (b * d) or (measured and b not in measured.microbatch_sizes):
                    continue
                m = problem.global_batch // (b * d)
                for name in problem.schedules:
                    if name == "zb-auto":
                        continue
                    for v in _chunk_choices(name, p, m, spec.layers, problem.microbatch_group):
                        if lowered_actions(p, m, v) > problem.max_actions:
                            if too_large is not None:
                                too_large.append(Candidate(t, p, d, b, m, name, v))
                            continue
                        shardings = problem.sharding if d > 1 else ("none",)
                        for rc, shard, ep in itertools.product(
                            problem.recompute, shardings, problem.ep_choices(d)
                        ):
                            for style in _styles(problem, p, d):
                                yield Candidate(t, p, d, b, m, name, v, rc, t > 1, style, cp, shard, ep)


def _styles(problem: Problem, p: int, d: int) -> tuple[str, ...]:
    """Mapping styles worth scoring: stage- or replica-major, and the walk reversed (which end holds the
    embedding and which the head matters on mixed devices and small graphs)."""
    base = ("pp", "dp") if p > 1 and d > 1 else ("pp",)
    kinds = problem.device_kinds()
    if p > 1 and (len(kinds) > 1 or len(problem.topology.devices) <= 64):
        base += tuple(f"{s}-rev" for s in base)
    return base


def _chunk_choices(name: str, p: int, m: int, layers: int, group: int | None = None) -> list[int]:
    entry = info(name)
    if p == 1:
        return [1] if entry.chunks is None or 1 in entry.chunks else []
    choices = entry.chunks if entry.chunks is not None else (2, 3, 4, 6, 8)
    out = []
    for v in choices:
        if p * v > layers:
            continue
        try:
            grouping.check(name, p, m, v, group)
        except PipewrightError:
            continue
        out.append(v)
    return out


def _stage_costs(ctx: _Context, c: Candidate, dmap: DeviceMap) -> list[StageCost]:
    prob = ctx.problem
    if prob.profile is not None:  # measured on the profile's device: the same on every rank
        return [prob.profile.stage_cost(c.microbatch)] * c.pp
    pc = parts_of(prob, c)
    state = pc.state(c.dp, c.pp)  # bytes per parameter: the optimizer sharding over dp × cp
    out = []
    for i in range(c.pp):
        block = dmap.block(i, 0)  # the stage's first (tp × cp) block, tp fastest
        group = block[: c.tp]  # its tensor-parallel ranks
        ring = block[:: c.tp]  # the context-parallel group of its tp rank 0
        experts = tuple(dmap.block(i, j)[0] for j in range(c.ep))  # its ep group: ep dp replicas
        kinds = ctx.stage_kinds(dmap, i)
        best = None
        sigs = (ctx.signature(group), ctx.signature(ring), ctx.signature(experts))
        for kind in sorted(kinds):
            key = (kind, sigs, c.microbatch, c.tp, c.recompute, c.sequence_parallel, c.cp, c.sharding, c.ep)
            key += (state,)
            sc = ctx.cost_cache.get(key)
            if sc is None:
                gpu = accelerator(kind)
                sc = ctx.cost_cache[key] = stage_cost(
                    pc,
                    gpu,
                    prob.dtype,
                    prob.efficiency_for(kind),
                    ctx.all_reduce(group),
                    ctx.all_reduce(ring, "all_gather") if c.cp > 1 else None,
                    ctx.all_reduce(experts, "all_gather") if c.ep > 1 else None,
                    state,
                )
            if best is None or sc.layer > best.layer:
                best = sc
        out.append(best)
    return out


def estimate(ctx: _Context, c: Candidate, dmap: DeviceMap | None = None, layers=None) -> Evaluated:
    """Partition (or take ``layers`` per rank) and estimate one candidate (module docstring).
    Raises DoesNotFitError when no partition fits memory."""
    prob = ctx.problem
    if dmap is None:
        order = ctx.order[::-1] if c.style.endswith("-rev") else ctx.order
        style = c.style.removesuffix("-rev")
        dmap = map_devices(order, c.block, c.pp, c.dp, style)
        if len(ctx.kinds) > 1:
            dmap = slowest_first(prob.topology, dmap, prob.dtype, ctx.speeds)
    costs = _stage_costs(ctx, c, dmap)
    boundary, grad_bytes = messages(prob, c)
    p, v = c.pp, c.virtual
    in_flight = grouping.in_flight(c.schedule, p, c.microbatches, v, prob.microbatch_group)
    ends = end_chunks_in_flight(c.schedule, p, c.microbatches, v, prob.microbatch_group)
    limits = [ctx.stage_memory_limit(dmap, i) for i in range(p)]
    if layers is None:
        if p * v > prob.spec.layers:
            raise DoesNotFitError("more chunks than layers")
        # memory does not depend on the transfers: a layout that fits nowhere is dropped before the
        # boundary links are priced (path searches on large graphs)
        if not fits_somewhere(stage_terms(costs, [0.0] * p, in_flight, limits, ends), prob.spec.layers, v):
            raise DoesNotFitError("no partition fits the memory limit")
    weights = costs[0].layer_weights(prob.spec)  # a mixture of experts' lighter first dense layers
    comm = []
    for i in range(p):
        if p == 1 or (i == p - 1 and v == 1):
            comm.append(0.0)
            continue
        a, b = dmap.head(i), dmap.head((i + 1) % p)
        comm.append(v * boundary(ctx, a, b))  # one transfer per direction
    terms = stage_terms(costs, comm, in_flight, limits, ends)
    if layers is None:
        layers = _partition(terms, prob.spec.layers, v, weights).layers
    work = _work_per_rank(layers, weights)
    times = [t.time(x) for t, x in zip(terms, work, strict=True)]
    mems = [t.memory(x) for t, x in zip(terms, work, strict=True)]
    fits = all(mem <= t.memory_limit for mem, t in zip(mems, terms, strict=True))
    t_max = max(times)
    chunks = chunk_layout(layers, v) if v > 1 else tuple(layers)
    reductions = None
    if c.dp * c.cp > 1:  # dense gradients over dp × cp, routed experts' over dp/ep × cp (rank 0's groups)
        replicas = [dmap.block(0, j)[:: c.tp] for j in range(c.dp)]  # each replica's cp ranks
        dense_ar = ctx.all_reduce(tuple(x for r in replicas for x in r))
        expert_ar = ctx.all_reduce(tuple(x for r in replicas[:: c.ep] for x in r))
        reductions, below = [], grad_bytes(0, False)  # the bytes of the chunks before: embedding only
        for s in range(len(chunks)):
            held = sum(chunks[: s + 1])  # layers up to this chunk's (cumulative: MoE dense ones first)
            upto = grad_bytes(held, s == len(chunks) - 1)
            # like(): the difference keeps the reduction's collective calls (cost.sharding)
            dense, expert = (like(upto[k] - (below[k] if s else 0.0), upto[k]) for k in (0, 1))
            below = grad_bytes(held, False)
            reductions.append(dense_ar(dense) + (expert_ar(expert) if expert else 0.0))
    est = _ordered(prob, c, costs, chunks, comm, reductions)  # the order priced (plan/chunked.py)
    est += _optimizer_step(prob, c, dmap, layers, ctx)
    return Evaluated(c, chunks, dmap.ranks, est, t_max, max(mems), fits=fits)


def _optimizer_step(
    prob: Problem, c: Candidate, dmap: DeviceMap, layers: Sequence[int], ctx: _Context | None = None
) -> float:
    """The slowest rank's optimizer step where the framework prices one (the ``STEP`` the simulation
    appends after each rank's work, :func:`pipewright.cost.dispatch.optimizer_seconds`): its parameters
    × the step's bytes per parameter (the fp32 state's over the replicas with a sharded optimizer) / the
    device's memory bandwidth, + its tensor-parallel all-reduces (:func:`_step_tp_seconds`) and a tied
    model's table's (:func:`_step_tied_seconds`); 0 otherwise."""
    if prob.profile is not None:
        return 0.0
    pc, worst = parts_of(prob, c), 0.0
    tp = _step_tp_seconds(prob, c, dmap, layers, ctx) if ctx is not None and c.tp > 1 else [0.0] * c.pp
    tied = _step_tied_seconds(prob, c, dmap, ctx) if ctx is not None and c.pp > 1 else {}
    for r, n in enumerate(layers):
        kind = prob.topology.nodes[dmap.head(r)].accelerator
        per_param = prob.efficiency_for(kind).optimizer_bytes
        if per_param <= 0:
            continue
        if pc.sharding != "none":
            per_param = 2.0 + (per_param - 2.0) / (c.dp * c.cp)
        first, last = r == 0, r == len(layers) - 1
        params = n * pc.layer.params + first * pc.embed.params + last * pc.head.params
        params -= pc.shared_params if first and last else 0.0
        worst = max(worst, params * per_param / accelerator(kind).memory_bandwidth + tp[r] + tied.get(r, 0.0))
    return worst


def _step_tp_seconds(prob: Problem, c: Candidate, dmap: DeviceMap, layers: Sequence[int], ctx) -> list[float]:
    """Per rank, the optimizer step's tensor-parallel all-reduces as the cost model prices them
    (:func:`pipewright.cost.sharding.tp_step_bytes`): with sequence parallelism one a chunk of its
    replicated parameters' gradients, and the gradient norm's Σ g² (8 bytes)."""
    chunks = chunk_layout(layers, c.virtual) if c.virtual > 1 else tuple(layers)
    place = order_placement(c.schedule, c.pp, c.microbatches, c.virtual, prob.microbatch_group)
    grad = GRAD_DTYPE_BYTES[parts_of(prob, c).grad_dtype]
    out = []
    for r in range(c.pp):
        ar = ctx.all_reduce(dmap.block(r, 0)[: c.tp])
        seconds = ar(8.0)
        for s, n in enumerate(chunks):
            replicated = replicated_parameters(prob.spec, n, s == len(chunks) - 1)
            if place[s] == r and c.sequence_parallel and replicated:
                seconds += ar(grad * replicated)
        out.append(seconds)
    return out


def _step_tied_seconds(prob: Problem, c: Candidate, dmap: DeviceMap, ctx) -> dict[int, float]:
    """The ranks of the first and the last chunk → the all-reduce of a tied model's table gradient
    between them (:func:`pipewright.cost.sharding.tied_step_bytes`: V·h/t in the gradient dtype); {}
    untied or when one rank holds both ends."""
    pc = parts_of(prob, c)
    place = order_placement(c.schedule, c.pp, c.microbatches, c.virtual, prob.microbatch_group)
    ends = (place[0], place[c.pp * c.virtual - 1])
    if not pc.shared_params or ends[0] == ends[1]:
        return {}
    seconds = ctx.all_reduce((dmap.head(ends[0]), dmap.head(ends[1])))(
        pc.shared_params * GRAD_DTYPE_BYTES[pc.grad_dtype]
    )
    return dict.fromkeys(ends, seconds)


def _ordered(prob: Problem, c: Candidate, costs: Sequence[StageCost], chunks, comm, reductions=None) -> float:
    """The schedule's order priced with each chunk's F, B, I and W seconds (its layers, the embedding
    on chunk 0, the output layer on the last), one boundary transfer per hop and each chunk's
    gradient reduction after its last backward (``reductions``, seconds; None: d = 1)."""
    p, n = c.pp, len(chunks)
    weights = costs[0].layer_weights(prob.spec)
    work = _work_per_rank(chunks, weights)
    place = order_placement(c.schedule, p, c.microbatches, c.virtual, prob.microbatch_group)
    f, b, i, w = [], [], [], []
    for s in range(n):
        sc = costs[place[s]]
        ends = (s == 0, s == n - 1)
        (li, lw), (ei, ew), (hi, hw) = sc.split()
        for out, layer, embed, head in (
            (f, sc.layer_f, sc.embed_f, sc.head_f),
            (b, sc.layer_b, sc.embed_b, sc.head_b),
            (i, li, ei, hi),
            (w, lw, ew, hw),
        ):
            out.append(layer * work[s] + ends[0] * embed + ends[1] * head)
    hop = max(comm) / c.virtual if comm else 0.0
    group = prob.microbatch_group
    args = (c.schedule, p, c.microbatches, c.virtual, group, f, b, hop, (i, w), reductions)
    return chunked_time(*args)


def _work_per_rank(layers: Sequence[int], weights: Sequence[float] | None) -> list[float]:
    """Each rank's layers in units of one layer (``weights`` per layer, or all 1)."""
    if weights is None:
        return [float(n) for n in layers]
    out, pos = [], 0
    for n in layers:
        out.append(sum(weights[pos : pos + n]))
        pos += n
    return out


def _partition(terms, num_layers: int, v: int, weights: Sequence[float] | None = None):
    """Rank-level partition; for v chunks per rank identical layers make contiguity free, so the
    per-rank layer counts are partitioned as if contiguous, each rank holding ≥ v layers (one per
    chunk); :func:`~pipewright.plan.partition.chunk_layout` then splits each rank's layers over its
    chunks."""
    return partition(terms, num_layers, weights, min_layers=v)


@dataclass
class SearchResult:
    best: Evaluated
    finalists: list[Evaluated]
    baselines: list[Evaluated]
    considered: int
    pruned: int
    infeasible: int
    seconds: float
    #: baselines computed but left out: none of their layouts fits (the summary says so)
    dropped_baselines: list[str] = field(default_factory=list)


def search(
    prob: Problem,
    progress: Callable[[int, int], None] | None = None,
    baselines: Sequence[Evaluated] = (),
) -> SearchResult:
    """Estimate every candidate (pruned by :func:`lower_bound`), simulate the best ``prob.finalists``
    and ``baselines``' configurations re-planned, and return the fastest that fits."""
    start = time.perf_counter()
    ctx = _Context(prob, device_order(prob.topology))
    too_large: list[Candidate] = []
    cands = list(candidates(prob, too_large))
    if not cands and too_large:
        raise ConfigError(_too_large(prob, too_large, "every layout is over"))
    if not cands:
        raise ConfigError(
            f"no (tp, pp, dp, microbatch) divides {len(prob.topology.devices)} devices and global batch "
            f"{prob.global_batch}; change --global-batch-size or the device count"
        )
    pool, per_schedule, pruned, infeasible = _estimated(ctx, cands, progress)
    if not pool and too_large:
        raise ConfigError(_too_large(prob, too_large, "no layout that fits in memory is under"))
    if not pool:
        raise DoesNotFitError(
            f"{prob.spec.name} fits nowhere on {len(prob.topology.devices)} devices of this topology at "
            f"global batch {prob.global_batch}: every layout needs more memory than a device has; add "
            "devices or use a smaller model"
        )
    finalists = _refined(prob, _simulated(ctx, pool, per_schedule, baselines))
    best = finalists[0]
    for ev in finalists[1:]:
        ev.label = "runner-up"
        ev.why = why_slower(best, ev)
    return SearchResult(
        best, finalists, list(baselines), len(cands), pruned, infeasible, time.perf_counter() - start
    )


def _estimated(
    ctx: _Context, cands: Sequence[Candidate], progress: Callable[[int, int], None] | None
) -> tuple[list[Evaluated], dict[str, Evaluated], int, int]:
    """The candidates estimated in the order of their lower bounds, until the bound passes the
    ``finalists``-th best estimate: the best estimates that fit (at most 4 × finalists), each
    schedule's best, and the counts pruned and not fitting."""
    prob = ctx.problem
    bounds = sorted((lower_bound(ctx, c), k, c) for k, c in enumerate(cands))
    pool: list[Evaluated] = []
    per_schedule: dict[str, Evaluated] = {}  # each schedule's best estimate
    pruned = infeasible = 0
    for k, (lb, _, c) in enumerate(bounds):
        if progress is not None:
            progress(k + 1, len(bounds))
        if len(pool) >= prob.finalists and lb > pool[prob.finalists - 1].estimate:
            pruned += len(bounds) - k
            break
        if not may_fit(ctx, c):
            infeasible += 1
            continue
        try:
            ev = estimate(ctx, c)
        except DoesNotFitError:
            infeasible += 1
            continue
        if not ev.fits:
            infeasible += 1
            continue
        pool.append(ev)
        if c.schedule not in per_schedule or ev.estimate < per_schedule[c.schedule].estimate:
            per_schedule[c.schedule] = ev
        pool.sort(key=lambda e: e.estimate)
        del pool[4 * prob.finalists :]
    if progress is not None:
        progress(len(bounds), len(bounds))
    return pool, per_schedule, pruned, infeasible


def _simulated(
    ctx: _Context, pool: list[Evaluated], per_schedule: dict[str, Evaluated], baselines: Sequence[Evaluated]
) -> list[Evaluated]:
    """The finalists simulated: the best estimates, each schedule's best, and the baselines' own
    configurations re-planned (partition + mapping)."""
    prob = ctx.problem
    # the best estimates, and each schedule's best: what the estimate leaves out (per-link transfer
    # times, FSDP's re-gathering) differs by schedule, so one schedule's near-ties must not crowd out
    # another's best
    chosen = pool[: prob.finalists]
    chosen += [
        ev
        for ev in per_schedule.values()
        if all(ev.candidate.schedule != f.candidate.schedule for f in chosen)
    ]
    finalists = [simulate_plan(prob, ev) for ev in chosen]
    for base in baselines:  # the baselines' own configurations, re-planned, compete too
        bc = base.candidate
        if any(f is not None and f != x for f, x in zip(prob.fixed, (bc.tp, bc.pp, bc.dp), strict=True)):
            continue
        try:
            ev = estimate(ctx, base.candidate)
        except DoesNotFitError:
            continue
        if ev.fits and all(ev.candidate != f.candidate for f in finalists):
            finalists.append(simulate_plan(prob, ev))
    return finalists


def _refined(prob: Problem, finalists: list[Evaluated]) -> list[Evaluated]:
    """The finalists, fastest first, the best refined (partition, device order, zb-auto's cost-aware
    order, recomputation per stage); a one-line DoesNotFitError when none fits."""
    # every finalist also tries the uniform partition and the given device order, the best is refined
    # (on meshes over LARGE_MESH devices each simulation prices thousands of groups: only the best is
    # refined and zb-auto's memory-limit search is left out)
    n = len(prob.topology.devices)
    if n <= LARGE_MESH:
        light = 3 if n <= 64 else 1
        finalists = [refine(prob, ev, budget=light) for ev in finalists]
    finalists.sort(key=lambda e: (not e.fits, e.time))
    finalists[0] = refine(prob, finalists[0])
    if "zb-auto" in prob.schedules and n <= LARGE_MESH:
        finalists.extend(cost_aware_order(prob, finalists[0]))
    finalists.sort(key=lambda e: (not e.fits, e.time))
    finalists[0] = per_stage_recompute(prob, finalists[0])
    if not finalists[0].fits:
        hint = "add devices"
        if prob.recompute_partial:  # the estimate priced plain full recomputation
            method = dict(prob.recompute_partial)
            hint += (
                f" or recompute more layers (--recompute-method {method.get('recompute_method')} "
                f"--recompute-num-layers {method.get('recompute_num_layers', 1)} keeps the other layers' "
                "activations)"
            )
        raise DoesNotFitError(f"{prob.spec.name}: no finalist fits in memory in simulation; {hint}")
    return finalists


def _too_large(prob: Problem, skipped: list[Candidate], which: str) -> str:
    """The one-line refusal when the layouts left are too large to simulate (``--max-actions``)."""
    small = min(skipped, key=lambda c: lowered_actions(c.pp, c.microbatches, c.virtual))
    size = lowered_actions(small.pp, small.microbatches, small.virtual)
    return (
        f"global batch {prob.global_batch}: {which} --max-actions {prob.max_actions:,} (the smallest "
        f"skipped, t={small.tp} p={small.pp} d={small.dp} b={small.microbatch} m={small.microbatches}, "
        f"simulates about {size:,} actions); raise --max-actions or lower --global-batch-size"
    )
