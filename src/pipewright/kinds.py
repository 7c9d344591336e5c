"""Actions and action kinds: the vocabulary of the schedule IR.

An :class:`Action` is a small immutable value ``(stage, kind, microbatch, payload)`` whose string form is
``torch.distributed.pipelining``'s (``"2F0"``, ``"1SEND_F3"``, ``"0REDUCE_GRAD"``). A :class:`KindSpec`
describes everything the core needs to handle one kind — its dependency rule, what it completes, whether it
computes, its point-to-point (:class:`P2P`) or collective (:class:`Collective`) metadata, its completeness
rule and its activation-memory delta — so that lowering, the validator, the simulator and the executor
derive their behaviour from the spec, never from the kind's name. Kinds live in an immutable
:class:`KindRegistry` that features extend with ``registry.with_kinds(...)``.

An :data:`Event` is an action that has completed: ``(kind, stage, microbatch, payload)``. Carrying the
payload lets two actions of one kind, stage and microbatch (e.g. K-FAC curvature of two layers) be told
apart everywhere, as the simulator's cost key already did.

This module sits below :mod:`pipewright.ir` and :mod:`pipewright.deps` and imports neither (no circle).
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pipewright.ir import Schedule

# Core kind names (the strings are torch.distributed.pipelining's _ComputationType values).
F = "F"
B = "B"
I = "I"
W = "W"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"
REDUCE_GRAD = "REDUCE_GRAD"
STEP = "STEP"

#: Operations a :class:`Collective` may name, and the groups every runtime knows.
COLLECTIVE_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "barrier")
MESH_GROUPS = ("dp", "pp", "tp")


class Action(NamedTuple):
    """One thing a rank does: ``kind`` on model chunk ``stage`` for ``microbatch``.

    ``microbatch`` is ``None`` for per-stage actions (REDUCE_GRAD, STEP after a flush).
    ``payload`` carries extra identity for extension kinds (e.g. a K-FAC layer index).
    """

    stage: int
    kind: str
    microbatch: int | None = None
    payload: Any = None

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.payload is not None:
            text += f":{self.payload}"
        return text

    @property
    def event(self) -> Event:
        """The action's own event ``(kind, stage, microbatch, payload)``."""
        return (self.kind, self.stage, self.microbatch, self.payload)


#: An event is an action that has completed; requirements are expressed as events.
Event = tuple[str, int, "int | None", Any]


def event_action(event: Event) -> Action:
    """The action whose own event ``event`` is (for messages)."""
    kind, stage, mb, payload = event
    return Action(stage, kind, mb, payload)


@dataclass(frozen=True, slots=True)
class P2P:
    """Point-to-point metadata of a send or receive kind.

    ``role``: ``"send"`` or ``"recv"``. ``pair``: the kind at the other end (SEND_F ↔ RECV_F).
    ``offset``: peer stage − own stage (SEND_F +1: it feeds the next stage; RECV_F −1). The matching
    action of ``Action(s, kind, k, payload)`` is ``Action(s + offset, pair, k, payload)``.
    ``tensor``: the name of what it carries; the executor looks up how to produce (send) and shape
    (receive) a tensor by this name (core: ``"activation"`` and ``"activation_grad"``).
    ``attach``: the compute kinds :func:`~pipewright.passes.lower.lower` puts it next to — a send right
    after, a receive right before each of them, when the peer stage sits on another rank.
    """

    role: str
    pair: str
    offset: int
    tensor: str
    attach: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ("send", "recv"):
            raise ValueError(f"P2P role must be 'send' or 'recv' (got {self.role!r})")
        if self.offset == 0:
            raise ValueError("P2P offset 0 would talk to its own stage")


@dataclass(frozen=True, slots=True)
class Collective:
    """Collective metadata: the operation and the process group it runs over.

    ``group``: ``"dp"``, ``"tp"``, ``"pp"`` or a feature's named group. Within the simulated pipeline (one
    data-parallel replica, one tensor-parallel rank per stage), dp and tp collectives involve only copies
    of the same rank; a ``"pp"`` collective is a rendezvous of the pipeline ranks in ``members`` (all of
    them when ``members`` is None) — actions of this kind with the same microbatch and payload, one on
    each member — which starts when the last member reaches it. ``members(action, schedule)`` returns
    pipeline ranks (a named subgroup of the pipeline).
    """

    op: str
    group: str
    members: Callable[[Action, Schedule], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"collective op {self.op!r} unknown; choose one of {', '.join(COLLECTIVE_OPS)}")

    def participants(self, action: Action, schedule: Schedule) -> tuple[int, ...]:
        """Pipeline ranks that take part (only the action's own rank for dp/tp groups)."""
        if self.members is not None:
            return tuple(self.members(action, schedule))
        if self.group == "pp":
            return tuple(range(schedule.num_ranks))
        return (schedule.placement[action.stage],)

    @property
    def spans_pipeline(self) -> bool:
        return self.group == "pp" or self.members is not None


#: A completeness rule: the events a valid schedule must produce, each with a phrase naming the kinds
#: that may produce it (for the error message).
Completeness = Callable[["Schedule"], Iterable[tuple[Event, str]]]


@dataclass(frozen=True, slots=True)
class KindSpec:
    """Description of one action kind.

    requires(action, schedule) -> events that must have happened (anywhere) before ``action`` starts.
    produces(action, schedule) -> events ``action`` completes (by default its own
    ``(kind, stage, microbatch, payload)``). ``compute``: occupies the rank's compute stream. ``p2p``
    / ``collective``: communication metadata (at most one). ``complete``: a completeness rule the
    validator checks — always when ``always`` is True (F, I, W: every stage runs every microbatch),
    otherwise only for schedules that contain the kind. ``memory``: change in activation memory, in
    units of one microbatch of one chunk. ``torch``: the kind exists in torch.distributed.pipelining's
    CSV format. ``per_microbatch``: True when the action must name a microbatch, False when it never
    does (per-stage actions), None either way.

    Rules (``requires``, ``produces``, ``complete``, ``Collective.members``) must be picklable —
    module-level functions or small dataclass instances such as :class:`pipewright.deps.after` — because
    schedules travel to worker processes.
    """

    name: str
    requires: Callable[[Action, Schedule], tuple[Event, ...]]
    produces: Callable[[Action, Schedule], tuple[Event, ...]] | None = None
    compute: bool = True
    p2p: P2P | None = None
    collective: Collective | None = None
    complete: Completeness | None = None
    always: bool = False
    memory: int = 0
    torch: bool = False
    per_microbatch: bool | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.p2p is not None and self.collective is not None:
            raise ValueError(f"kind {self.name}: a kind is point-to-point or collective, not both")
        if self.compute and (self.p2p is not None or self.collective is not None):
            raise ValueError(f"kind {self.name}: communication kinds do not occupy the compute stream")

    @property
    def comm(self) -> str | None:
        """``"send"``/``"recv"`` for point-to-point kinds, ``"collective"``, or None."""
        if self.p2p is not None:
            return self.p2p.role
        return "collective" if self.collective is not None else None

    def events(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        if self.produces is None:
            return ((action.kind, action.stage, action.microbatch, action.payload),)
        return self.produces(action, schedule)


class KindRegistry(Mapping[str, KindSpec]):
    """Immutable mapping kind name → :class:`KindSpec`. ``with_kinds`` returns an extended copy.

    Point-to-point pairs must be registered together: each ``p2p.pair`` names a registered kind of the
    opposite role whose own ``pair`` points back with the opposite offset.
    """

    __slots__ = ("_attached", "_specs")

    def __init__(self, specs: Iterable[KindSpec] = ()) -> None:
        self._specs: dict[str, KindSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ValueError(f"action kind {spec.name!r} registered twice")
            self._specs[spec.name] = spec
        for spec in self._specs.values():
            if spec.p2p is None:
                continue
            other = self._specs.get(spec.p2p.pair)
            if (
                other is None
                or other.p2p is None
                or other.p2p.pair != spec.name
                or other.p2p.role == spec.p2p.role
                or other.p2p.offset != -spec.p2p.offset
            ):
                raise ValueError(
                    f"kind {spec.name}: its pair {spec.p2p.pair!r} must be a registered "
                    "point-to-point kind of the opposite role and offset that pairs back"
                )
        attached: dict[str, list[KindSpec]] = {}
        for spec in self._specs.values():
            for kind in spec.p2p.attach if spec.p2p else ():
                attached.setdefault(kind, []).append(spec)
        self._attached = {k: tuple(v) for k, v in attached.items()}

    def __getitem__(self, name: str) -> KindSpec:
        return self._specs[name]

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def with_kinds(self, *specs: KindSpec) -> KindRegistry:
        """A new registry with ``specs`` added (extension by registration)."""
        return KindRegistry([*self._specs.values(), *specs])

    def attached_to(self, kind: str) -> tuple[KindSpec, ...]:
        """The point-to-point kinds lowering places around actions of ``kind``."""
        return self._attached.get(kind, ())

    def of_role(self, role: str) -> frozenset[str]:
        """Names of the kinds whose :attr:`KindSpec.comm` is ``role``."""
        return frozenset(n for n, s in self._specs.items() if s.comm == role)

    def __repr__(self) -> str:
        return f"KindRegistry({', '.join(self._specs)})"
