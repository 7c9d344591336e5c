"""Lowering: insert the point-to-point actions a compute-only schedule implies.

Every point-to-point kind names, in its :class:`~pipewright.kinds.P2P` metadata, the compute kinds it is
attached to and the stage it talks to. Around each action of such a compute kind, lowering puts the
attached receives right before it and the attached sends right after it, whenever the peer stage exists
and sits on another rank: after ``F(s, k)`` a ``SEND_F(s, k)`` to stage s+1, before it a
``RECV_F(s, k)`` from stage s−1; ``SEND_B``/``RECV_B`` likewise around the backward (``B`` or ``I``).
Feature kinds get their transfers by the same rule. Adjacent stages on one rank (the V placement's
turn) hand over locally. Receives sit immediately before their consumer, so a rank blocks on a receive
only where it would wait for the data anyway: lowering adds no deadlock. The runtime posts the
receives earlier, non-blocking.
"""

from __future__ import annotations

from pipewright.ir import Action, Schedule


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with its explicit point-to-point actions (idempotent)."""
    if schedule.lowered:
        return schedule
    kinds = schedule.kinds
    n = schedule.num_stages
    placement = schedule.placement
    # kind -> ((name, offset, is_receive), ...) of the transfers attached to it
    around = {
        name: tuple((s.name, s.p2p.offset, s.p2p.role == "recv") for s in kinds.attached_to(name))
        for name in kinds
    }
    rows = []
    for row in schedule.actions:
        out: list[Action] = []
        append = out.append
        for a in row:
            attached = around.get(a[1])
            if not attached:
                append(a)
                continue
            stage = a[0]
            sends = []
            for name, offset, is_recv in attached:
                peer = stage + offset
                if not 0 <= peer < n or placement[peer] == placement[stage]:
                    continue
                moved = Action(stage, name, a[2], a[3])
                if is_recv:
                    append(moved)
                else:
                    sends.append(moved)
            append(a)
            out.extend(sends)
        rows.append(out)
    return schedule.with_actions(rows, lowered=True)


def strip_comms(schedule: Schedule) -> Schedule:
    """The compute-only form: drop point-to-point actions (inverse of :func:`lower`)."""
    rows = [[a for a in row if schedule.kinds[a.kind].p2p is None] for row in schedule.actions]
    return schedule.with_actions(rows, lowered=False)
