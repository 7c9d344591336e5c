"""1F1B with its steady-state forward and backward paired for overlap (``1f1b-overlap``).

DeepSeek-V3 (arXiv 2412.19437, §3.2.1) overlaps the forward of one microbatch with the backward of
another so that the communication of each (the experts' dispatch and combine all-to-alls) proceeds
while the other computes; DualPipe(V) builds its schedule around such F&B pairs. Megatron-LM's
"combined 1F1B" (``overlap_moe_expert_parallel_comm``) brings the same overlap to 1F1B: in the steady
state rank r runs F(k + w) and B(k) together, w = min(p − r − 1, m) its warm-up forwards.

Here the order is exactly 1F1B's (:func:`pipewright.schedules.classic.one_f_one_b_rows`); only
``meta["overlapped_pairs"]`` is added, in DualPipeV's format (per rank, the position of each pair's F
in the compute-only order; its B is the next action): on rank r the steady-state F(w + k) sits at
position w + 2k and is paired with B(k), for k < m − w. Without overlap the schedule is 1F1B action
for action: the same makespan, the same peak min(p − r, m) microbatches in flight on rank r.

The last rank (w = 0) has no pairs: its F(k) and B(k) are the same microbatch, the B needing the F's
output. Megatron instead adds a warm-up forward there, pairing F(k + 1) with B(k) — at the cost of one
more microbatch in flight on that rank and a later first backward; this schedule keeps 1F1B's order.
"""

from __future__ import annotations

from fractions import Fraction

from pipewright.ir import Schedule, loop_placement
from pipewright.schedules.classic import one_f_one_b_rows
from pipewright.schedules.schedule_info import ScheduleInfo


def steady_pairs(p: int, m: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the compute-order positions of the steady-state forwards F(w + k), k < m − w, each
    paired with the B(k) right after it (w = min(p − r − 1, m); none on the last rank, w = 0)."""
    out = []
    for r in range(p):
        w = min(p - r - 1, m)
        out.append(tuple(w + 2 * k for k in range(m - w)) if w > 0 else ())
    return tuple(out)


def one_f_one_b_overlap(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B's order with each steady-state F(k + w) and B(k) marked as an overlapped pair (module
    docstring). Bubble (p − 1)/m without overlap, as 1F1B; memory min(p − r, m) on rank r."""
    rows = one_f_one_b_rows(p, m)
    return Schedule.build("1f1b-overlap", m, rows, loop_placement(p), overlapped_pairs=steady_pairs(p, m))


SCHEDULES = (
    ScheduleInfo(
        name="1f1b-overlap",
        build=one_f_one_b_overlap,
        memory=lambda p, m, v: [Fraction(min(p - r, m)) for r in range(p)],
        bubble="(p − 1)/m as 1F1B, pairs in turn; overlapped, each pair max(c_F + c_B, x_F + x_B)",
        memory_formula="min(p − r, m) on rank r",
        order_of="1f1b",
        source="Megatron-LM's combined 1F1B (overlap_moe_expert_parallel_comm); DeepSeek-V3 (2412.19437)",
    ),
)
