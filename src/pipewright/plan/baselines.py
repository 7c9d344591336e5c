"""The baselines the planner reports next to its plan, each simulated like the plan.

- **uniform**: the plan's own degrees, schedule and recomputation, but Megatron's uniform partition
  (⌊L/p⌋ layers per stage) and the devices in the topology's given order (tp-dp-pp rank order); when
  that does not fit in memory, the first runner-up's configuration whose uniform layout fits.
- **megatron**: Megatron-LM's rules of thumb (Narayanan et al. SC21 §3.3): tensor parallelism inside a
  machine (t = devices per host, at most 8, dividing the heads), pipeline parallelism across machines —
  the smallest p that fits in memory — then data parallelism; microbatch 1, full recomputation,
  1F1B, uniform layers, devices in the given order.
- **pipedream**: PipeDream's planner (Narayanan et al. SOSP 2019) on a hierarchical view of the
  bandwidths — level 1 the fastest link inside a machine, level 2 the slowest host egress per device —
  no tensor parallelism; for each p its dynamic programme over layer ranges minimising the bottleneck
  max(compute, boundary transfer at the level's bandwidth, weight all-reduce over the replicas at that
  level) with one replication factor for all stages (what synchronous 1F1B runs), recomputation only
  when the model does not fit otherwise; devices in the given order, replicas of a stage on one level.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipewright.models.layout import uniform_layer_counts
from pipewright.plan.costs import parts, stage_cost
from pipewright.plan.mapping import given_order
from pipewright.plan.partition import DoesNotFitError, StageTerms, dp_partition
from pipewright.plan.problem import lowered_actions, tp_splits
from pipewright.plan.search import Candidate, Evaluated, Problem, _Context, estimate, simulate_plan


def _hosts(prob: Problem) -> dict[str | None, list[str]]:
    hosts: dict[str | None, list[str]] = {}
    for d in prob.topology.devices:
        hosts.setdefault(prob.topology.host(d), []).append(d)
    return hosts


def _run(
    ctx: _Context, c: Candidate, label: str, layers: Sequence[int] | None, check_fit: bool = True
) -> Evaluated | None:
    prob = ctx.problem
    if lowered_actions(c.pp, c.microbatches, c.virtual) > prob.max_actions:
        return None  # too large to simulate (--max-actions)
    dmap = given_order(prob.topology, c.block, c.pp, c.dp)
    per_rank = layers if layers is not None else uniform_layer_counts(prob.spec.layers, c.pp)
    try:
        ev = estimate(ctx, c, dmap, layers=tuple(per_rank))
    except DoesNotFitError:
        return None
    if check_fit and not ev.fits:
        return None
    ev = simulate_plan(prob, ev)
    ev.label = label
    return ev


def uniform_baseline(ctx: _Context, plan: Candidate) -> Evaluated | None:
    """The plan's degrees with a uniform partition and the devices as given."""
    if plan.virtual > 1:
        chunks = uniform_layer_counts(ctx.problem.spec.layers, plan.pp * plan.virtual)
        ranks = [sum(chunks[k * plan.pp + r] for k in range(plan.virtual)) for r in range(plan.pp)]
        ev = _run(ctx, plan, "uniform", ranks, check_fit=False)
        if ev is not None:
            ev.chunk_layers = tuple(chunks)
            ev = simulate_plan(ctx.problem, ev)
        return ev
    return _run(ctx, plan, "uniform", None)


def megatron_baseline(ctx: _Context) -> Evaluated | None:
    """Megatron's rules (module docstring)."""
    prob = ctx.problem
    n = len(prob.topology.devices)
    per_host = max(len(v) for v in _hosts(prob).values())
    t = min(per_host, 8)
    while t > 1 and (n % t or not tp_splits(prob.spec, t)):
        t //= 2
    for p in range(1, n // t + 1):
        if (n // t) % p or p > prob.spec.layers:
            continue
        d = n // (t * p)
        if prob.global_batch % d:
            continue
        c = Candidate(t, p, d, 1, prob.global_batch // d, "1f1b", 1, "full", False, "dp")
        ev = _run(ctx, c, "megatron", None)
        if ev is not None and ev.fits:
            return ev
    return None


def pipedream_baseline(ctx: _Context) -> Evaluated | None:
    """PipeDream's DP over a two-level bandwidth hierarchy (module docstring)."""
    prob = ctx.problem
    topo = prob.topology
    n = len(topo.devices)
    hosts = _hosts(prob)
    per_host = max(len(v) for v in hosts.values())
    devs = topo.devices
    fast = max((topo.path(devs[0], d).bandwidth for d in devs[1:per_host]), default=float("inf"))
    slow = min(
        (topo.path(devs[0], d).bandwidth for d in devs if topo.host(d) != topo.host(devs[0])),
        default=fast,
    )
    best: tuple[float, Candidate, tuple[int, ...]] | None = None
    for p in range(1, min(n, prob.spec.layers) + 1):
        if n % p:
            continue
        d = n // p
        if prob.global_batch % d:
            continue
        m = prob.global_batch // d
        for rc in ("none", "full"):
            gpu = topo.accelerator(devs[0])
            pc = parts(prob.spec_for(1), 1, 1, rc, False, prob.dtype, prob.efficiency_for(), gpu=gpu.name)
            sc = stage_cost(pc, gpu, prob.dtype, prob.efficiency_for(gpu.name), lambda x: 0.0)
            # replicas of a stage sit on one level: inside a machine if d fits there, else across
            bw_rep = fast if d <= per_host else slow
            bw_pp = fast if d * p <= per_host else slow
            ar = 2 * (d - 1) / d * pc.layer.params * pc.grad_bytes / bw_rep if d > 1 else 0.0
            xfer = 2 * pc.boundary_bytes / bw_pp if p > 1 else 0.0
            # PipeDream's stage time: max(compute per microbatch, the all-reduce amortised over m)
            terms = [
                StageTerms(
                    sc.layer + ar / m,
                    sc.time(0, i == 0, i == p - 1) + xfer * (i < p - 1),
                    sc.layer_static,
                    sc.memory(0, i == 0, i == p - 1, 0.0),
                    sc.layer_act,
                    (i == 0) * sc.embed_act + (i == p - 1) * sc.head_act,
                    float(min(p - i, m)),
                    gpu.memory_bytes if prob.memory_limit is None else prob.memory_limit,
                )
                for i in range(p)
            ]
            try:
                part = dp_partition(terms, prob.spec.layers)
            except DoesNotFitError:
                continue
            c = Candidate(1, p, d, 1, m, "1f1b", 1, rc, False, "dp")
            est = (m - 1) * part.bottleneck + part.total
            if best is None or est < best[0]:
                best = (est, c, part.layers)
            break  # recomputation only when needed
    return None if best is None else _run(ctx, best[1], "pipedream", best[2])
