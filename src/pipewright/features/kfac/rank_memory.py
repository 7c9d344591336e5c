"""K-FAC's memory on each pipeline rank of a priced schedule: what ``pipewright simulate --fill kfac``
adds to its memory by parts and its fit check, and what ``train --dry-run --measure --optimizer kfac``
compares the measured program with (``measure/kfac_side.py``) — one function, :func:`kfac_ranks`.

The schedule is the one ``train --optimizer kfac`` runs: the run's, with a ``KFAC_FILL`` in every
predicted bubble and a ``KFAC_PRECOND`` after each stage's last backward
(:func:`~pipewright.features.kfac.fill.slot_schedule`), and its bubbles run the planned curvature tasks
(:func:`~pipewright.features.kfac.curvature_memory.plan_fills`). On rank r, with S its static bytes
(the cost model's :meth:`static_bytes`), the peak with K-FAC is

    S + state + max(activations, step transient + step + held)

- ``state``: the factors and inverses, fp32, all step (:meth:`RankLinears.state_bytes`);
- ``activations``: the rank's program-order activation peak
  (:func:`~pipewright.sim.memory.peak_from_deltas`, as the simulator takes it, transients included)
  with K-FAC's bytes (:func:`~pipewright.features.kfac.curvature_memory.memory_deltas`) added at each
  action of the recording iteration;
- the optimizer step's: the step's fp32 gradient copies
  (:func:`~pipewright.cost.chunk_memory.step_transient_bytes`), its KL-clip (``step``,
  :meth:`RankLinears.step_bytes`) and what K-FAC still holds after the iteration's last action
  (``held``: inputs and gradients of tasks left for later bubbles, the preconditioned gradients).

Pure Python; the simulator's helpers are imported when a function runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KfacRank:
    """K-FAC on one pipeline rank: ``plan`` (a :class:`~.curvature_memory.FillPlan`), ``state``
    (factors and inverses, bytes), ``activations`` (the rank's activation peak with K-FAC's bytes, above
    static), ``held`` (K-FAC's bytes still live after the iteration's last action), ``step`` (what its
    optimizer step adds, :meth:`~.curvature_memory.RankLinears.step_bytes`), ``step_transient`` (the
    step's fp32 gradient copies), ``flops`` (of its bubble and preconditioning actions, by kind)."""

    plan: object
    state: float
    activations: float
    held: float
    step: float
    step_transient: float
    flops: dict[str, float]

    @property
    def at_step(self) -> float:
        """The bytes above static + ``state`` at the optimizer step: step transient + step + held."""
        return self.step_transient + self.step + self.held

    @property
    def peaks_at_step(self) -> bool:
        """Whether the peak is the optimizer step's (:attr:`at_step` above the activations' peak)."""
        return self.at_step > self.activations

    def peak(self, static: float) -> float:
        """The rank's peak with K-FAC over ``static`` bytes (the module's formula)."""
        return static + self.state + max(self.activations, self.at_step)


def priced(cost) -> bool:
    """Whether :func:`kfac_ranks` prices K-FAC's memory for ``cost``: an analytical transformer cost of
    a family whose covered layers are listed (:data:`~.curvature_memory.BLOCKS`)."""
    from pipewright.features.kfac.curvature_memory import block_linears

    spec = getattr(cost, "spec", None)
    if spec is None or not hasattr(cost, "layers_of") or not hasattr(cost, "mesh"):
        return False
    return block_linears(spec, cost.mesh.tp) is not None


def kfac_ranks(cost, schedule) -> dict[int, KfacRank]:
    """Per pipeline rank, K-FAC's memory and bubble plan over ``schedule`` (the run's, compute-only)
    priced by ``cost`` (its model, tp, microbatch, compute dtype and accelerator); {} where it is not
    priced (:func:`priced`)."""
    if not priced(cost):
        return {}
    from pipewright.cost.chunk_memory import step_transient_bytes
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

    block = block_linears(cost.spec, cost.mesh.tp)
    slotted, budgets = slot_schedule(schedule)
    layers = cost.layers_of(schedule)
    tokens = cost.microbatch * cost.spec.seq_len
    element = cost.activation_bytes_per_element
    rate = 0.5 * accelerator(cost.gpu).peak("fp32")
    transient = transient_of(cost)
    base_cost = getattr(cost, "inner", cost)
    out = {}
    for rank in range(slotted.num_ranks):
        row = slotted.actions[rank]
        linears = RankLinears.of({s: layers[s] for s in slotted.stages_of(rank)}, block)
        estimates = curvature_estimates(linears, tokens, rate, rank_unit(cost, schedule, rank))
        fills = plan_fills(row, linears, budgets, estimates)
        extra = memory_deltas(row, linears, fills, tokens, element)
        base = [0.0 if a.kind in KFAC_KINDS_ALL else float(cost.activation_bytes(a, schedule)) for a in row]
        trans = [0.0 if a.kind in KFAC_KINDS_ALL else float(transient(a, schedule)) for a in row]
        peak = peak_from_deltas([b + e for b, e in zip(base, extra, strict=True)], 0.0, trans)
        stepping = step_transient_bytes(base_cost.cost_inputs, base_cost.rank_parameters(rank, schedule))
        out[rank] = KfacRank(
            FillPlan(fills, len(linears.layers)),
            linears.state_bytes(),
            peak,
            sum(extra),
            linears.step_bytes(),
            float(stepping),
            task_flops(row, linears, fills, tokens),
        )
    return out
