"""The simulated side of ``--optimizer kfac`` (PipeFisher's K-FAC in the bubbles): its memory per rank
as :mod:`pipewright.features.kfac.curvature_memory` prices it, over the schedule with a ``KFAC_FILL`` in every
bubble (the one ``train`` runs), and the bubble plan the measured program follows (the same tasks in
the same bubbles as the prediction: the runtime's fills by measured durations would move with the
machine's load).

The peak is the rank's program-order memory (:func:`~pipewright.sim.memory.peak_from_deltas`, as the
simulator takes it) with K-FAC's bytes added at each action of the recording iteration; its factors
and inverses are static (``kfac_state``); what K-FAC still holds at the iteration's end (inputs and
gradients of tasks left for later bubbles, the preconditioned gradients) is there at the optimizer
step too."""

from __future__ import annotations

from dataclasses import dataclass

_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class KfacRank:
    """K-FAC on one pipeline rank: ``plan`` (a :class:`~pipewright.features.kfac.curvature_memory.FillPlan`),
    ``state`` (factors and inverses, bytes), ``activations`` (the rank's activation peak with K-FAC's
    bytes, above static), ``held`` (K-FAC's bytes still live after the iteration's last action),
    ``step`` (what its optimizer step adds,
    :meth:`~pipewright.features.kfac.curvature_memory.RankLinears.step_bytes`), ``flops`` (of its bubble and
    preconditioning actions, by kind)."""

    plan: object
    state: float
    activations: float
    held: float
    step: float
    flops: dict[str, float]


def kfac_ranks(run, setup) -> dict[int, KfacRank]:
    """Per pipeline rank, K-FAC's memory and plan; {} unless the run trains with ``--optimizer kfac``
    a model whose covered layers are priced (:data:`~pipewright.features.kfac.curvature_memory.BLOCKS`)."""
    c = run.config
    if c.optimizer != "kfac":
        return {}
    from pipewright.features.kfac.curvature_memory import (
        FillPlan,
        RankLinears,
        block_linears,
        curvature_estimates,
        memory_deltas,
        plan_fills,
        rank_unit,
        task_flops,
    )
    from pipewright.features.kfac.fill import slot_schedule
    from pipewright.features.kfac.kinds import KFAC_KINDS_ALL
    from pipewright.hardware import accelerator
    from pipewright.sim.memory import peak_from_deltas, transient_of

    cost, sched = setup.cost, setup.schedule
    block = block_linears(run.spec, c.tp)
    if block is None or not hasattr(cost, "layers_of"):
        return {}
    slotted, budgets = slot_schedule(sched)
    layers = cost.layers_of(sched)
    tokens = c.microbatch_size * run.spec.seq_len
    rate = 0.5 * accelerator(cost.gpu).peak("fp32")
    transient = transient_of(cost)
    out = {}
    for rank in range(slotted.num_ranks):
        row = slotted.actions[rank]
        linears = RankLinears.of({s: layers[s] for s in slotted.stages_of(rank)}, block)
        estimates = curvature_estimates(linears, tokens, rate, rank_unit(cost, sched, rank))
        fills = plan_fills(row, linears, budgets, estimates)
        extra = memory_deltas(row, linears, fills, tokens, _ELEMENT[c.precision])
        base = [0.0 if a.kind in KFAC_KINDS_ALL else float(cost.activation_bytes(a, sched)) for a in row]
        trans = [0.0 if a.kind in KFAC_KINDS_ALL else float(transient(a, sched)) for a in row]
        peak = peak_from_deltas([b + e for b, e in zip(base, extra, strict=True)], 0.0, trans)
        plan = FillPlan(fills, len(linears.layers))
        flops = task_flops(row, linears, fills, tokens)
        out[rank] = KfacRank(plan, linears.state_bytes(), peak, sum(extra), linears.step_bytes(), flops)
    return out
