"""Schedule costs from a cost model: what cost-aware generators (``zb-auto``) plan with.

:func:`schedule_costs` asks any :class:`~pipewright.cost.base.CostModel` (the transformer model, a
measured profile, unit costs) for the F, I and W time of each stage (model chunk) on a probe schedule
of the same shape, and a :class:`~pipewright.cost.base.CommModel` for the time of one stage-boundary
message — so the schedule a generator picks is the one for the model and cluster being simulated or
run, not for unit costs. Pure Python; it only calls the protocols' methods.
"""

from __future__ import annotations

from typing import Any

from pipewright.ir import SEND_F, Action, F, I, Schedule, W, loop_placement
from pipewright.schedules.schedule_info import ScheduleCosts


def probe_schedule(ranks: int, chunks: int = 1, microbatches: int = 1) -> Schedule:
    """An action-free schedule of the given shape (loop placement), for asking per-stage costs."""
    return Schedule(
        name="probe",
        num_ranks=ranks,
        num_stages=ranks * chunks,
        num_microbatches=microbatches,
        placement=loop_placement(ranks, chunks),
        actions=tuple(() for _ in range(ranks)),
    )


def schedule_costs(
    cost: Any,
    ranks: int,
    chunks: int = 1,
    *,
    comm: Any = None,
    memory_limit: float | None = None,
) -> ScheduleCosts:
    """Per-stage F, I, W times of ``cost`` for ``ranks`` × ``chunks`` stages, the boundary message time
    (``comm.p2p_time`` between pipeline ranks 0 and 1 of ``cost.message_bytes`` of a SEND_F; 0 without
    ``comm`` or with one rank) and ``memory_limit`` (microbatches in flight per rank)."""
    probe = probe_schedule(ranks, chunks)
    stages = range(probe.num_stages)

    def times(kind: str) -> tuple[float, ...]:
        return tuple(float(cost.compute_time(Action(s, kind, 0), probe)) for s in stages)

    message = 0.0
    if comm is not None and ranks > 1:
        message = float(comm.p2p_time(0, 1, cost.message_bytes(Action(0, SEND_F, 0), probe)))
    return ScheduleCosts(times(F), times(I), times(W), message, memory_limit)
