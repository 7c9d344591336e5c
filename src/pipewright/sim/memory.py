"""Activation memory over time: the running sum of each compute action's ``activation_bytes``, and
while an action runs its ``transient_bytes`` on top (a recomputing backward's re-created activations:
one layer's, :func:`~pipewright.cost.chunk_memory.recompute_transient`, a mixture of experts' layer
with the expert activations of the tokens routed to the rank,
:meth:`~pipewright.cost.moe_cost.MoECost.moe_layer_transient`, or a group of layers under Megatron-LM's
``--recompute-method``, :mod:`pipewright.cost.partial_recompute`; the backward's own gradient buffers
are not counted; cost models without the method have none).

An action's positive delta (F) is allocated when it starts; a negative delta (B, W) is freed when it
ends — the conservative reading for a measured timeline, and on one compute stream the same peak as
the running sum in program order (what the simulator reports): the highest over actions of the live
bytes after the action and of the live bytes before it + its transient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the simulator imports this module for peak_from_deltas alone)
    from pipewright.cost.base import CostModel
    from pipewright.ir import Schedule
    from pipewright.timeline import Timeline


def _none(action: Any, schedule: Any) -> float:
    return 0.0


def transient_of(cost: Any) -> Callable[[Any, Any], float]:
    """``cost.transient_bytes`` (bytes an action holds while it runs), or 0 for every action."""
    return getattr(cost, "transient_bytes", _none)


def peak_from_deltas(
    deltas: Iterable[float], static: float = 0.0, transients: Iterable[float] | None = None
) -> float:
    """static + max(0, max prefix sum of ``deltas``, max of (prefix sum before an action + its
    ``transients`` entry)): the peak of a rank's memory in program order."""
    live = peak = 0.0
    if transients is None:
        for d in deltas:
            live += d
            if live > peak:
                peak = live
        return static + peak
    for d, extra in zip(deltas, transients, strict=True):
        if live + extra > peak:
            peak = live + extra
        live += d
        if live > peak:
            peak = live
    return static + peak


def memory_profile(
    timeline: Timeline, schedule: Schedule, cost: CostModel
) -> list[list[tuple[float, float]]]:
    """Per rank, the step function [(time, bytes in use from then on), …] over the timeline's compute
    spans (all iterations), starting from ``cost.static_bytes``."""
    profiles = []
    transient = transient_of(cost)
    for rank in range(timeline.num_ranks):
        changes: list[tuple[float, int, float]] = []
        for span in timeline.rank_spans(rank):
            delta = float(cost.activation_bytes(span.action, schedule))
            extra = float(transient(span.action, schedule))
            if delta > 0:  # with a transient (a split backward's I), what it keeps is there by its end
                changes.append((span.end if extra else span.start, 1, delta))
            elif delta < 0:
                changes.append((span.end, 0, delta))  # at equal times, frees before allocations
            if extra:
                changes.append((span.start, 1, extra))
                changes.append((span.end, 0, -extra))
        live = float(cost.static_bytes(rank, schedule))
        steps = [(timeline.start, live)]
        for time, _, delta in sorted(changes):
            live += delta
            steps.append((time, live))
        profiles.append(steps)
    return profiles


def peak_memory(timeline: Timeline, schedule: Schedule, cost: CostModel) -> list[float]:
    """Highest memory in use on each rank over the timeline (static + activations)."""
    return [max(b for _, b in steps) for steps in memory_profile(timeline, schedule, cost)]
