"""Simulator-guided refinements of the planner's best candidates: local search over the partition and
the device assignment (:func:`refine`), and recomputation decided per stage (:func:`per_stage_recompute`).
Both simulate every trial in full; their budgets shrink with the schedule's size and the mesh's."""

from __future__ import annotations

import itertools
from dataclasses import replace

from pipewright.models.layout import uniform_layer_counts
from pipewright.plan.cost_options import RECOMPUTE_ORDER
from pipewright.plan.problem import Evaluated, Problem
from pipewright.plan.simulated import simulate_plan

#: Chunk × tp·d device pricings the refinements may spend (each trial prices every chunk's collectives).
_MESH_PRICINGS = 400_000


def refine(prob: Problem, ev: Evaluated, budget: int | None = None) -> Evaluated:
    """Simulator-guided local search around a finalist. Starting points: its own partition and
    mapping, the uniform partition, and the topology's given device order. Moves: one layer across a
    chunk boundary, and (p ≤ 8) swapping two ranks' devices, with or without their layers. The best
    improvement is taken until none is left or ``budget`` simulations are spent. (Stages with equal
    bottleneck still differ in fill and drain, and the closed form cannot see which order of heavy and
    light stages, or of fast and slow devices, the schedule prefers.)"""
    from pipewright.plan.mapping import given_order

    c = ev.candidate
    p, v = c.pp, c.virtual
    if p == 1:
        return ev
    if budget is None:
        # about 10⁵ microbatch-chunks (6·10⁵ lowered actions) in all, and 4·10⁵ chunk × tp·d device
        # pricings (each trial prices every chunk's collectives over its groups: large meshes)
        sims = 100_000 // (p * c.microbatches * v)
        budget = max(4, min(64, sims, _MESH_PRICINGS // (p * v * c.block * c.dp)))
    block = c.block * c.dp

    def trial(layers: tuple[int, ...], devices: tuple[str, ...]) -> Evaluated:
        t = Evaluated(c, layers, devices, ev.estimate, ev.bottleneck, label=ev.label)
        return simulate_plan(prob, t)

    def neighbours(base: Evaluated):
        n = len(base.chunk_layers)
        for i in range(n - 1):
            for src, dst in ((i, i + 1), (i + 1, i)):
                layers = list(base.chunk_layers)
                if layers[src] > 1:
                    layers[src] -= 1
                    layers[dst] += 1
                    yield tuple(layers), base.devices
        if p <= 8:
            for i, j in itertools.combinations(range(p), 2):
                devs = list(base.devices)
                devs[i * block : (i + 1) * block], devs[j * block : (j + 1) * block] = (
                    devs[j * block : (j + 1) * block],
                    devs[i * block : (i + 1) * block],
                )
                yield base.chunk_layers, tuple(devs)
                layers = list(base.chunk_layers)
                for k in range(v):
                    layers[k * p + i], layers[k * p + j] = layers[k * p + j], layers[k * p + i]
                yield tuple(layers), tuple(devs)

    seen = {(ev.chunk_layers, ev.devices)}
    best = ev
    uni = uniform_layer_counts(prob.spec.layers, p * v)
    given = given_order(prob.topology, c.block, p, c.dp).ranks
    for start in ((uni, ev.devices), (ev.chunk_layers, given), (uni, given)):
        if start in seen:
            continue
        seen.add(start)
        budget -= 1
        t = trial(*start)
        if t.fits and t.time < best.time:
            best = t
    improved = True
    while improved and budget > 0:
        improved = False
        base = best
        for key in neighbours(base):
            if key in seen or budget <= 0:
                continue
            seen.add(key)
            budget -= 1
            t = trial(*key)
            if t.fits and t.time < best.time * (1 - 1e-9):
                best, improved = t, True
    return best


def per_stage_recompute(prob: Problem, ev: Evaluated) -> Evaluated:
    """Recomputation as a per-stage decision: the schedule keeps fewer microbatches in flight on later
    ranks (1F1B: p − r on rank r), so they may afford less recomputation than rank 0. From the last
    rank to the first, each rank's chunks try every lighter mode that ``--recompute`` offers (none,
    then selective, then op: :data:`~pipewright.plan.cost_options.RECOMPUTE_ORDER`); a change is
    kept when the simulated plan still fits and is faster. At most 2p simulations (p ≤ 16), fewer on
    large meshes (``_MESH_PRICINGS``)."""
    c = ev.candidate
    # only the modes the user offered (--recompute full alone keeps every stage at full)
    order = tuple(m for m in RECOMPUTE_ORDER if m in prob.recompute)
    if c.recompute == "none" or c.pp == 1 or c.pp > 16:
        return ev
    n = len(ev.chunk_layers)
    best = ev
    modes = list(ev.recompute_per_stage or (c.recompute,) * n)
    budget = max(2, _MESH_PRICINGS // (c.pp * c.virtual * c.block * c.dp))  # as refine's, large meshes
    for r in reversed(range(c.pp)):
        chunks = [k * c.pp + r for k in range(c.virtual)]
        for mode in order[: order.index(modes[chunks[0]])]:
            if budget <= 0:
                return best
            budget -= 1
            trial_modes = list(modes)
            for k in chunks:
                trial_modes[k] = mode
            t = replace(best, recompute_per_stage=tuple(trial_modes), simulated=None, label=ev.label)
            t = simulate_plan(prob, t)
            if t.fits and t.time < best.time * (1 - 1e-9):
                best, modes = t, trial_modes
                break
    return best
