"""What keeps the planner fast on 16,384-device clusters: lazy device maps (equal to the eager deal),
closed-form partition capacities (the same feasibility as the binary search) and stage costs shared
by groups of equal signature (the same estimate)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.models.presets import resolve_model
from pipewright.plan.mapping import map_devices
from pipewright.plan.partition import DoesNotFitError, StageTerms, dp_partition, fits_somewhere
from pipewright.plan.problem import Candidate, Problem
from pipewright.plan.search import _Context, candidates, estimate, may_fit
from pipewright.topology import cluster


def _eager(order, b, p, d, style):
    """The deal written out: block g = order[g·b : (g + 1)·b], g = j·p + i (pp) or i·d + j (dp)."""
    groups = [tuple(order[g * b : (g + 1) * b]) for g in range(p * d)]
    if style == "pp":
        return [[groups[j * p + i] for j in range(d)] for i in range(p)]
    return [[groups[i * d + j] for j in range(d)] for i in range(p)]


@pytest.mark.parametrize("style", ["pp", "dp"])
def test_lazy_map_equals_the_eager_deal(style):
    order = [f"g{k}" for k in range(48)]
    for b, p, d in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 4)):
        dmap = map_devices(order, b, p, d, style)
        grid = _eager(order, b, p, d, style)
        assert [[dmap.block(i, j) for j in range(d)] for i in range(p)] == grid
        flat = tuple(x for stage in grid for replica in stage for x in replica)
        ranks = dmap.ranks
        assert ranks == flat and hash(ranks) == hash(flat) and len(ranks) == len(flat)
        assert [ranks[g] for g in range(len(flat))] == list(flat)
        assert all(dmap.head(i) == grid[i][0][0] for i in range(p))


_term = st.builds(
    StageTerms,
    st.floats(0.1, 3),
    st.floats(0, 3),
    st.floats(0.1, 3),
    st.floats(0, 5),
    st.floats(0, 1),
    st.floats(0, 2),
    st.sampled_from([1.0, 2.0, 4.0]),
    st.floats(1, 120),
    st.floats(0, 1),
)


@settings(max_examples=40, deadline=None)
@given(terms=st.lists(_term, min_size=1, max_size=5), layers=st.integers(1, 16), k=st.integers(1, 2))
def test_fits_somewhere_agrees_with_the_exact_partition(terms, layers, k):
    if len(terms) * k > layers:
        assert not fits_somewhere(terms, layers, k)
        return
    try:
        dp_partition(terms, layers, min_layers=k)
        exact = True
    except DoesNotFitError:
        exact = False
    assert fits_somewhere(terms, layers, k) == exact


def test_stage_costs_are_priced_once_per_group_signature():
    """On 64 identical nodes every tp group inside a node has one signature: pricing a 16-stage
    pipeline prices one stage cost, and the estimate is the one pricing each group apart gives."""
    topo = cluster(64, 8, "h100-sxm")
    prob = Problem(resolve_model("llama3-8b"), topo, 512, recompute=("full",))
    c = Candidate(8, 16, 4, 1, 128, "1f1b", 1, "full", True, "pp")
    ctx = _Context(prob, tuple(topo.devices))
    ev = estimate(ctx, c)
    assert len(ctx.cost_cache) == 1
    ref = _Context(prob, tuple(topo.devices))
    ref.signature = lambda group: group  # every group priced apart
    assert estimate(ref, c).estimate == ev.estimate
    assert len(ref.cost_cache) == 16


def test_the_memory_check_before_mapping_drops_only_what_estimate_drops():
    topo = cluster(2, 8, "h100-sxm")
    prob = Problem(resolve_model("llama3-8b", seq_len=4096), topo, 64, recompute=("none", "full"))
    ctx = _Context(prob, tuple(topo.devices))
    for c in itertools.islice(candidates(prob), 0, None, 7):
        if may_fit(ctx, c):
            continue
        with pytest.raises(DoesNotFitError):
            estimate(ctx, c)
