"""Lowering: insert the point-to-point actions a compute-only schedule implies.

After ``F(s, k)`` whose next stage sits on another rank, ``SEND_F(s, k)``; before ``F(s, k)`` whose
previous stage sits on another rank, ``RECV_F(s, k)``; likewise ``SEND_B`` after and ``RECV_B`` before
the backward (``B`` or ``I``). Adjacent stages on one rank (the V placement's turn) hand over locally.
Receives sit immediately before their consumer, so a rank blocks on a receive only where it would wait
for the data anyway: lowering adds no deadlock. The runtime posts the receives earlier, non-blocking.
"""

from __future__ import annotations

from pipewright.ir import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Schedule


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with explicit SEND_F/RECV_F/SEND_B/RECV_B actions (idempotent)."""
    if schedule.lowered:
        return schedule
    last = schedule.num_stages - 1
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        for a in row:
            s, k = a.stage, a.microbatch
            if a.kind == F:
                if s > 0 and not schedule.local(s - 1, s):
                    out.append(Action(s, RECV_F, k))
                out.append(a)
                if s < last and not schedule.local(s, s + 1):
                    out.append(Action(s, SEND_F, k))
            elif a.kind in (B, I):
                if s < last and not schedule.local(s, s + 1):
                    out.append(Action(s, RECV_B, k))
                out.append(a)
                if s > 0 and not schedule.local(s - 1, s):
                    out.append(Action(s, SEND_B, k))
            else:
                out.append(a)
        rows.append(out)
    return schedule.with_actions(rows, lowered=True)


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only form: drop point-to-point actions (inverse of :func:`lower`)."""
    rows = [
        [a for a in row if schedule.kinds[a.kind].comm not in ("send", "recv")] for row in schedule.actions
    ]
    return schedule.with_actions(rows, lowered=False)
