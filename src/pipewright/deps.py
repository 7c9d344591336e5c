"""The dependency rules: what must have completed before each action may start.

This is the one place that knows them; the validator, the lowering pass, the simulator and the runtime
all ask :func:`requires` / :func:`produces` (through the schedule's :class:`~pipewright.kinds.KindRegistry`).

Requirements are *events* ``(kind, stage, microbatch, payload)``. A full backward ``B`` completes both
the input-gradient event ``I`` and the weight-gradient event ``W``, so schedules that split the backward
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

A receive of any point-to-point kind requires the matching send (:func:`matching_send`); a send's peer
and its matching receive come from the kind's :class:`~pipewright.kinds.P2P` metadata. A feature whose
compute kind takes data from another stage writes its rule with :func:`from_stage`, as F does.

The core rules are data — a :class:`pattern` of :class:`Term` s (F is ``Term(F, -1, RECV_F)``: F of the
previous stage, or the receive when that stage is on another rank) — so they are evaluated per action
here and per kind, over integer arrays, by the simulator (:mod:`pipewright.sim.lowered_compile`).
A feature's rule may be either; plain functions are called per action everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipewright.kinds import (
    P2P,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    STEP,
    Action,
    B,
    Collective,
    Event,
    F,
    I,
    KindRegistry,
    KindSpec,
    W,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pipewright.ir import Schedule


def crosses(schedule: Schedule, a: int, b: int) -> bool:
    """True when data between stages a and b travels through explicit send/receive actions."""
    return schedule.lowered and schedule.placement[a] != schedule.placement[b]


def from_stage(
    schedule: Schedule, action: Action, producer: str, source: int, receive: str
) -> tuple[Event, ...]:
    """The event ``action`` needs from stage ``source``: ``producer``'s event there when the two stages
    share a rank (or the schedule is not lowered), else the ``receive`` kind's event on ``action``'s
    stage. No event when ``source`` is outside the pipeline."""
    if not 0 <= source < schedule.num_stages:
        return ()
    stage, k, p = action[0], action[2], action[3]
    if schedule.lowered and schedule.placement[source] != schedule.placement[stage]:
        return ((receive, stage, k, p),)
    return ((producer, source, k, p),)


@dataclass(frozen=True)
class Term:
    """One event of a :class:`pattern` rule, relative to the action ``(s, kind, k, p)``:

    - ``offset == 0``: ``(kind, s, k, p)`` (payload ``None`` when ``payload`` is False);
    - ``offset != 0`` with ``receive``: :func:`from_stage` — ``kind``'s event on stage ``s + offset``,
      or the ``receive`` kind's event on stage s when that stage sits on another rank of a lowered
      schedule, and no event when ``s + offset`` is outside the pipeline;
    - ``offset != 0`` without ``receive``: ``(kind, s + offset, k, p)`` (a receive's matching send).
    """

    kind: str
    offset: int = 0
    receive: str | None = None
    payload: bool = True

    def event(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        stage, k = action[0], action[2]
        p = action[3] if self.payload else None
        if self.offset == 0:
            return ((self.kind, stage, k, p),)
        if self.receive is None:
            return ((self.kind, stage + self.offset, k, p),)
        return from_stage(schedule, action, self.kind, stage + self.offset, self.receive)


@dataclass(frozen=True)
class pattern:
    """A rule (``requires`` or ``produces``) written as a tuple of :class:`Term` s: the events of its
    terms, in order. Because the rule is data, the simulator's array path
    (:mod:`pipewright.sim.lowered_compile`) evaluates it for all actions of a kind at once instead of
    calling it per action. Picklable."""

    terms: tuple[Term, ...]

    def __call__(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        out: tuple[Event, ...] = ()
        for term in self.terms:
            out += term.event(action, schedule)
        return out

    def template(self, spec: KindSpec) -> tuple[Term, ...]:
        """The terms of this rule for kind ``spec`` (the array path's view)."""
        return self.terms


_forward_requires = pattern((Term(F, -1, RECV_F),))
_backward_requires = pattern((Term(F, payload=False), Term(I, +1, RECV_B)))
_full_backward_produces = pattern((Term(I, payload=False), Term(W, payload=False)))
_weight_requires = pattern((Term(I, payload=False),))


@dataclass(frozen=True)
class after:
    """A rule: the action needs ``kind``'s event of its own stage, microbatch and payload (a send needs
    what it sends). A picklable value, so schedules travel to worker processes."""

    kind: str

    def __call__(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        return ((self.kind, action.stage, action.microbatch, action.payload),)

    def template(self, spec: KindSpec) -> tuple[Term, ...]:
        return (Term(self.kind),)


@dataclass(frozen=True)
class _MatchingSend:
    """A receive's rule: the matching send on the peer stage, from the kind's P2P metadata."""

    def __call__(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        spec = schedule.kinds[action.kind].p2p
        return ((spec.pair, action.stage + spec.offset, action.microbatch, action.payload),)

    def template(self, spec: KindSpec) -> tuple[Term, ...]:
        return (Term(spec.p2p.pair, spec.p2p.offset),)


#: A receive's rule: the matching send on the peer stage.
matching_send = _MatchingSend()


def _all_weight_grads(stage: int, schedule: Schedule) -> tuple[Event, ...]:
    return tuple((W, stage, k, None) for k in range(schedule.num_microbatches))


def _reduce_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return _all_weight_grads(action.stage, schedule)


def _step_requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    if action.microbatch is not None:
        return ((W, action.stage, action.microbatch, None),)
    events = _all_weight_grads(action.stage, schedule)
    if has_kind(schedule, REDUCE_GRAD):
        events += ((REDUCE_GRAD, action.stage, None, None),)
    return events


@dataclass(frozen=True)
class every_microbatch:
    """A completeness rule: every stage produces ``kind``'s event for every microbatch (``via`` names
    the kinds that may produce it, for the message). Picklable."""

    kind: str
    via: str

    def covers(self) -> str:
        """The kind whose event every (stage, microbatch) must have (the array path's view)."""
        return self.kind

    def __call__(self, schedule: Schedule) -> Iterable[tuple[Event, str]]:
        for s in range(schedule.num_stages):
            for k in range(schedule.num_microbatches):
                yield (self.kind, s, k, None), self.via


def has_kind(schedule: Schedule, kind: str) -> bool:
    """Whether any rank of ``schedule`` runs an action of ``kind``."""
    return any(a.kind == kind for row in schedule.actions for a in row)


#: The core action kinds. Features extend with ``CORE_KINDS.with_kinds(KindSpec(...))``.
CORE_KINDS = KindRegistry(
    [
        KindSpec(
            F,
            _forward_requires,
            complete=every_microbatch(F, "F"),
            always=True,
            memory=1,
            torch=True,
            per_microbatch=True,
            description="forward",
        ),
        KindSpec(
            B,
            _backward_requires,
            _full_backward_produces,
            memory=-1,
            torch=True,
            per_microbatch=True,
            description="full backward (input and weight gradients)",
        ),
        KindSpec(
            I,
            _backward_requires,
            complete=every_microbatch(I, "B or I"),
            always=True,
            torch=True,
            per_microbatch=True,
            description="backward to the input",
        ),
        KindSpec(
            W,
            _weight_requires,
            complete=every_microbatch(W, "B or W"),
            always=True,
            memory=-1,
            torch=True,
            per_microbatch=True,
            description="backward to the weights",
        ),
        KindSpec(
            SEND_F,
            after(F),
            compute=False,
            p2p=P2P("send", RECV_F, +1, "activation", attach=(F,)),
            torch=True,
            per_microbatch=True,
            description="send a stage's output to the next stage",
        ),
        KindSpec(
            RECV_F,
            matching_send,
            compute=False,
            p2p=P2P("recv", SEND_F, -1, "activation", attach=(F,)),
            torch=True,
            per_microbatch=True,
            description="receive a stage's input",
        ),
        KindSpec(
            SEND_B,
            after(I),
            compute=False,
            p2p=P2P("send", RECV_B, -1, "activation_grad", attach=(B, I)),
            torch=True,
            per_microbatch=True,
            description="send the gradient of a stage's input to the previous stage",
        ),
        KindSpec(
            RECV_B,
            matching_send,
            compute=False,
            p2p=P2P("recv", SEND_B, +1, "activation_grad", attach=(B, I)),
            torch=True,
            per_microbatch=True,
            description="receive the gradient of a stage's output",
        ),
        KindSpec(
            REDUCE_GRAD,
            _reduce_requires,
            compute=False,
            collective=Collective("all_reduce", "dp"),
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


def matching_recv(action: Action, schedule: Schedule) -> Action:
    """The receive that consumes a send (``SEND_F(s,k)`` → ``RECV_F(s+1,k)``), from its P2P metadata."""
    spec = schedule.kinds[action.kind].p2p
    return Action(action.stage + spec.offset, spec.pair, action.microbatch, action.payload)


def peer_stage(action: Action, schedule: Schedule) -> int:
    """The stage a send goes to or a receive comes from."""
    return action.stage + schedule.kinds[action.kind].p2p.offset


def peer_rank(action: Action, schedule: Schedule) -> int:
    """The rank a send goes to or a receive comes from."""
    return schedule.placement[peer_stage(action, schedule)]


@dataclass(frozen=True)
class Resolution:
    """Every action's requirements and events, computed once for a schedule and shared by the validator
    and the simulator. Actions are numbered globally, rank by rank (``offsets[r]`` is rank r's first).

    ``requires`` / ``produces``: events per rank and position. ``producer``: event → global index of
    the (first) action producing it; ``duplicate``: ``(event, first, second)`` when an event is produced
    twice, else None. ``needs[g]``: the producer indices of action g's requirements, ``missing`` (= the
    number of actions) for a requirement nothing produces. Kinds the registry lacks resolve to no events
    (the validator reports them).
    """

    requires: list[list[tuple[Event, ...]]]
    produces: list[list[tuple[Event, ...]]]
    offsets: list[int]
    producer: dict[Event, int]
    duplicate: tuple[Event, int, int] | None
    needs: list[tuple[int, ...]]

    @property
    def missing(self) -> int:
        return self.offsets[-1]


def resolve(schedule: Schedule) -> Resolution:
    """The :class:`Resolution` of ``schedule`` (one call of each kind's rules per action)."""
    specs = dict(schedule.kinds.items())
    req_rule = {name: spec.requires for name, spec in specs.items()}
    prod_rule = {name: spec.produces for name, spec in specs.items()}
    reqs: list[list[tuple[Event, ...]]] = []
    outs: list[list[tuple[Event, ...]]] = []
    offsets = [0]
    producer: dict[Event, int] = {}
    duplicate = None
    g = 0
    for row in schedule.actions:
        rr: list[tuple[Event, ...]] = []
        oo: list[tuple[Event, ...]] = []
        for a in row:
            kind = a[1]
            rule = req_rule.get(kind)
            if rule is None:
                rr.append(())
                oo.append(())
                g += 1
                continue
            rr.append(rule(a, schedule))
            prod = prod_rule[kind]
            events = ((kind, a[0], a[2], a[3]),) if prod is None else prod(a, schedule)
            oo.append(events)
            for ev in events:
                first = producer.setdefault(ev, g)
                if first != g and duplicate is None:
                    duplicate = (ev, first, g)
            g += 1
        reqs.append(rr)
        outs.append(oo)
        offsets.append(g)
    get = producer.get
    needs = [tuple(get(ev, g) for ev in events) for rr in reqs for events in rr]
    return Resolution(reqs, outs, offsets, producer, duplicate, needs)
