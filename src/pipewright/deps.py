"""The dependency rules: what must have completed before each action may start.

This is the one place that knows them; the validator, the lowering pass, the simulator and the runtime
all ask :func:`requires` / :func:`produces` (through the schedule's :class:`~pipewright.ir.KindRegistry`).

Requirements are *events* ``(kind, stage, microbatch)``. A full backward ``B`` completes both the
input-gradient event ``I`` and the weight-gradient event ``W``, so schedules that split the backward
(zero bubble) and those that do not share one set of rules:

==========================  ==================================================================
action                      requires
==========================  ==================================================================
``F(s, k)``                 ``F(s-1, k)`` if stage s−1 is on the same rank or the schedule is not
                            lowered, else ``RECV_F(s, k)``
``B(s, k)``, ``I(s, k)``    ``F(s, k)``; and ``I(s+1, k)`` (same rank / not lowered) or ``RECV_B(s, k)``
``W(s, k)``                 ``I(s, k)``
``SEND_F(s, k)``            ``F(s, k)``                 (sends stage s's output to stage s+1)
``RECV_F(s, k)``            ``SEND_F(s-1, k)``          (receives stage s's input)
``SEND_B(s, k)``            ``I(s, k)``                 (sends stage s's input gradient to stage s−1)
``RECV_B(s, k)``            ``SEND_B(s+1, k)``
``REDUCE_GRAD(s)``          ``W(s, k)`` for every microbatch k
``STEP(s)``                 ``W(s, k)`` for every k, and ``REDUCE_GRAD(s)`` when the schedule has any
``STEP(s, k)``              ``W(s, k)`` (asynchronous schedules step after each backward)
==========================  ==================================================================
"""

from __future__ import annotations

from pipewright.ir import (
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    STEP,
    Action,
    B,
    Event,
    F,
    I,
    KindRegistry,
    KindSpec,
    Schedule,
    W,
)


def _crosses(schedule: Schedule, a: int, b: int) -> bool:
    """True when data between stages a and b travels through explicit send/receive actions."""
    return schedule.lowered and not schedule.local(a, b)


def _forward_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    s, k = action.stage, action.microbatch
    if s == 0:
        return ()
    if _crosses(schedule, s - 1, s):
        return ((RECV_F, s, k),)
    return ((F, s - 1, k),)


def _backward_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    s, k = action.stage, action.microbatch
    own = (F, s, k)
    if s == schedule.num_stages - 1:
        return (own,)
    if _crosses(schedule, s + 1, s):
        return (own, (RECV_B, s, k))
    return (own, (I, s + 1, k))


def _full_backward_produces(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((I, action.stage, action.microbatch), (W, action.stage, action.microbatch))


def _weight_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((I, action.stage, action.microbatch),)


def _send_f_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((F, action.stage, action.microbatch),)


def _recv_f_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((SEND_F, action.stage - 1, action.microbatch),)


def _send_b_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((I, action.stage, action.microbatch),)


def _recv_b_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((SEND_B, action.stage + 1, action.microbatch),)


def _all_weight_grads(stage: int, schedule: Schedule) -> tuple[Event, ...]:
    return tuple((W, stage, k) for k in range(schedule.num_microbatches))


def _reduce_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return _all_weight_grads(action.stage, schedule)


def _step_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    if action.microbatch is not None:
        return ((W, action.stage, action.microbatch),)
    events = _all_weight_grads(action.stage, schedule)
    if has_kind(schedule, REDUCE_GRAD):
        events += ((REDUCE_GRAD, action.stage, None),)
    return events


def has_kind(schedule: Schedule, kind: str) -> bool:
    """Whether any rank of ``schedule`` runs an action of ``kind``."""
    return any(a.kind == kind for row in schedule.actions for a in row)


#: The core action kinds. Features extend with ``CORE_KINDS.with_kinds(KindSpec(...))``.
CORE_KINDS = KindRegistry(
    [
        KindSpec(F, _forward_requires, memory=1, torch=True, per_microbatch=True, description="forward"),
        KindSpec(
            B,
            _backward_requires,
            _full_backward_produces,
            memory=-1,
            torch=True,
            per_microbatch=True,
            description="full backward (input and weight gradients)",
        ),
        KindSpec(I, _backward_requires, torch=True, per_microbatch=True, description="backward to the input"),
        KindSpec(
            W,
            _weight_requires,
            memory=-1,
            torch=True,
            per_microbatch=True,
            description="backward to the weights",
        ),
        KindSpec(SEND_F, _send_f_requires, compute=False, comm="send", torch=True, per_microbatch=True),
        KindSpec(RECV_F, _recv_f_requires, compute=False, comm="recv", torch=True, per_microbatch=True),
        KindSpec(SEND_B, _send_b_requires, compute=False, comm="send", torch=True, per_microbatch=True),
        KindSpec(RECV_B, _recv_b_requires, compute=False, comm="recv", torch=True, per_microbatch=True),
        KindSpec(
            REDUCE_GRAD,
            _reduce_requires,
            compute=False,
            comm="collective",
            torch=True,
            per_microbatch=False,
            description="data-parallel gradient reduction of a stage",
        ),
        KindSpec(STEP, _step_requires, description="optimizer step of a stage"),
    ]
)


def requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    """Events that must have completed before ``action`` starts."""
    return schedule.kinds[action.kind].requires(action, schedule)


def produces(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    """Events ``action`` completes."""
    return schedule.kinds[action.kind].events(action, schedule)


#: For each send kind, the receive kind that consumes it and the stage offset of the receiver.
SEND_TO_RECV: dict[str, tuple[str, int]] = {SEND_F: (RECV_F, +1), SEND_B: (RECV_B, -1)}


def matching_recv(action: Action) -> Action:
    """The receive that consumes a send: ``SEND_F(s,k)`` → ``RECV_F(s+1,k)``; ``SEND_B(s,k)`` →
    ``RECV_B(s-1,k)``."""
    kind, offset = SEND_TO_RECV[action.kind]
    return Action(action.stage + offset, kind, action.microbatch)


def peer_rank(action: Action, schedule: Schedule) -> int:
    """The rank a send goes to or a receive comes from."""
    offset = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}[action.kind]
    return schedule.placement[action.stage + offset]
