"""The planner's memory matches the simulation's static bytes: the optimizer state sharded over
dp × cp (ZeRO-1, FSDP), the routed experts' over their dp/ep × cp replicas, the gradient buffer's
dtype. A layout that fits only with ZeRO-1 is found, and the pruning bound (``may_fit``) never asks
for more memory than the simulated peak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipewright.models.presets import resolve_model
from pipewright.plan.bounds import may_fit
from pipewright.plan.mapping import device_order, map_devices
from pipewright.plan.partition import DoesNotFitError
from pipewright.plan.search import (
    Candidate,
    Problem,
    _Context,
    _stage_costs,
    candidates,
    estimate,
    search,
    simulate_plan,
)
from pipewright.plan.simulated import _lowered, plan_models
from pipewright.topology import cluster

#: parameters dominate (a 32k vocabulary, 16 tokens): the optimizer state decides what fits
SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 512, "vocab": 32000}
DENSE = resolve_model("llama", seq_len=16, **SHAPE)
MOE = replace(DENSE, moe_experts=4, moe_top_k=2)
TOPO = cluster(1, 8, "h100-sxm")


def _problem(spec=DENSE, **kw) -> Problem:
    base = {"recompute": ("none",), "microbatch_sizes": (1,), "finalists": 2, "schedules": ("1f1b",)}
    return Problem(spec, TOPO, 16, **{**base, **kw})


def _peak(prob: Problem, c: Candidate) -> float:
    ctx = _Context(prob, device_order(TOPO))
    return simulate_plan(prob, estimate(ctx, c)).simulated_memory


def test_a_layout_that_fits_only_with_zero1_is_found():
    fixed = (1, 2, 4)
    none, zero1 = (Candidate(1, 2, 4, 1, 4, "1f1b", sharding=s) for s in ("none", "zero1"))
    limit = (_peak(_problem(), none) + _peak(_problem(), zero1)) / 2
    prob = _problem(fixed=fixed, memory_limit=limit, sharding=("none", "zero1"))
    best = search(prob).best
    assert best.candidate.sharding == "zero1" and best.fits and best.simulated_memory <= limit
    with pytest.raises(DoesNotFitError):
        search(replace(prob, sharding=("none",)))


@pytest.mark.parametrize(
    ("spec", "sharding", "ep", "fields"),
    [
        (DENSE, "zero1", 1, ()),
        (DENSE, "fsdp", 1, (("fsdp_grad_sync", "step"),)),
        (DENSE, "none", 1, (("grad_dtype", "bf16"),)),
        (MOE, "zero1", 2, (("grad_dtype", "bf16"),)),
        (MOE, "fsdp", 2, ()),
    ],
)
def test_the_estimates_static_bytes_are_the_simulations(spec, sharding, ep, fields):
    prob = _problem(spec, sharding=(sharding,), cost_fields=fields)
    c = Candidate(1, 2, 4, 1, 4, "1f1b", sharding=sharding, ep=ep)
    ev = estimate(_Context(prob, device_order(TOPO)), c)
    cost, _ = plan_models(prob, ev)
    sched = _lowered(c.schedule, c.pp, c.microbatches, c.virtual, True)
    ctx = _Context(prob, device_order(TOPO))
    costs = _stage_costs(ctx, c, map_devices(ctx.order, c.block, c.pp, c.dp, "pp"))
    for r, n in enumerate(ev.chunk_layers):
        estimated = costs[r].memory(n, r == 0, r == c.pp - 1, 0.0)
        assert estimated == pytest.approx(cost.static_bytes(r, sched), rel=1e-12)


@pytest.mark.parametrize("spec", [DENSE, MOE])
def test_the_pruning_bound_is_never_above_the_simulated_peak(spec):
    """For every candidate, a memory limit equal to its simulated peak passes ``may_fit`` — with full
    recomputation too, whose transient the bound and the simulated peak both count."""
    prob = _problem(
        spec,
        recompute=("none", "full"),
        schedules=("1f1b", "interleaved-1f1b", "zb-h1"),
        sharding=("none", "zero1", "fsdp"),
        cost_fields=(("grad_dtype", "bf16"),) if spec.is_moe else (),
    )
    ctx = _Context(prob, device_order(TOPO))
    checked = 0
    for c in candidates(prob):
        if c.style != "pp" or (c.tp, c.cp) != (1, 1):
            continue
        peak = simulate_plan(prob, estimate(ctx, c)).simulated_memory
        assert may_fit(_Context(replace(prob, memory_limit=peak), ctx.order), c), c.describe()
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize(
    ("recompute", "attention"), [("full", "flash"), ("full", "eager"), ("selective", "eager")]
)
def test_the_estimate_counts_the_recomputation_transient_as_the_simulation_does(recompute, attention):
    """Activations matter here (512 tokens, a 256-token vocabulary): the estimate's peak — static +
    microbatches in flight × stored activations + one layer's transient — is the simulated peak."""
    shape = {"layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}
    spec = resolve_model("llama", seq_len=512, **shape)
    prob = _problem(spec, recompute=(recompute,), cost_fields=(("attention", attention),))
    c = Candidate(1, 4, 2, 1, 8, "1f1b", recompute=recompute)
    ev = estimate(_Context(prob, device_order(TOPO)), c)
    assert ev.peak_memory == pytest.approx(simulate_plan(prob, ev).simulated_memory, rel=1e-12)
    cost, _ = plan_models(prob, ev)
    assert cost.layer_transient() > 0
