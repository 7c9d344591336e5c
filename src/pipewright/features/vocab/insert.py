"""The schedule pass: insert the vocabulary actions into an existing schedule (1F1B, interleaved 1F1B,
V-Half, any compute-only schedule), placed from the stages' costs.

The pass list-schedules every rank on a clock driven by :class:`PlacementCosts` (the cost model's or a
profile's F, B, S, T and communication times): whenever a rank is free it runs, in this priority,

1. ``VT`` of its oldest microbatch whose barrier C0 has completed (alg1: it is on the path to the last
   stage's backward);
2. ``VS`` of the next microbatch whose X has been broadcast (naive: its second part ``VS`` once the
   MAX all-reduce ``VCM`` has completed, then the first part ``VSM`` of the next microbatch);
3. ``VEB`` whose ∇embedding has been broadcast, ``VEF`` up to a window ahead of the S passes;
4. the next action of the base schedule, if its inputs are there;
5. otherwise the next forward of the base schedule ahead of its turn — when the rank's activation
   memory stays within the base schedule's peak plus ``extra`` microbatches.

So the S/T steps land where the X broadcast and the barriers let them, whatever the schedule, and the
forwards run ahead only as far as the vocabulary round trip delays the last stage's backward: on 1F1B
the first rank ends with p + 2 microbatches in flight for Algorithm 1 (two barriers between the last
stage's forward and its backward), p + 1 for Algorithm 2 (one) and p + 3 for the naive algorithm
(three), against p. A collective is placed on
each participant before the first action that starts after its last input completed on the planning
clock — so every rank issues the collectives of one communicator in the same order, and the schedule
executes with blocking collectives (the validator's and the simulator's rendezvous). On plain 1F1B
the reference implementation's order (:mod:`.reference_choice`) is kept instead where the simulator
predicts it no slower. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipewright.errors import ScheduleError
from pipewright.features.vocab.kinds import (
    COLLECTIVE_KINDS,
    VBX,
    VC0,
    VC1,
    VCM,
    VEB,
    VEBC,
    VEC,
    VEF,
    VS,
    VSM,
    VT,
    home,
    registry,
)
from pipewright.features.vocab.reference_choice import reference_candidate, simulated_span
from pipewright.ir import Action, B, Event, F, I, Schedule, W

#: Extra microbatches of activation memory the 1F1B first rank needs (the paper's p + 2 / p + 1; one
#: per barrier between the last stage's forward and its backward, so p + 3 for the naive algorithm).
DEFAULT_EXTRA = {"alg1": 2, "alg2": 1, "naive": 3}
_COMPUTE_BASE = (F, B, I, W)
_COLLECTIVES = frozenset(COLLECTIVE_KINDS)
#: the vocabulary steps a rank takes (VBX/VEBC: issuing the broadcast; the others compute and issue
#: the collective they feed: VEF → VEC, VSM → VCM (naive), VS → VC0, VT → VC1 (naive, alg1))
_STEPS = (VEF, VBX, VSM, VS, VT, VEBC, VEB)
#: the collective each vocabulary compute step issues right after it ends
_FEEDS = {VEF: VEC, VSM: VCM, VS: VC0, VT: VC1}
_INF = float("inf")


@dataclass(frozen=True)
class PlacementCosts:
    """Durations the pass places by. ``compute(action)``: seconds of a compute action (base or
    vocabulary kind) on its rank. ``collective[kind]``: seconds of each vocabulary collective.
    ``p2p``: seconds of a stage-boundary transfer."""

    compute: Callable[[Action], float]
    collective: Mapping[str, float] = field(default_factory=dict)
    p2p: float = 0.0


def unit_vocab_times(algorithm: str) -> dict[str, float]:
    """Unit costs of the vocabulary passes that are not 1: the naive algorithm's S is one pass cut in two
    halves of 1/2 (``VSM``, ``VS``), so under unit costs it differs from Algorithm 1 by its barrier only."""
    return {VSM: 0.5, VS: 0.5} if algorithm == "naive" else {}


def unit_costs(algorithm: str = "alg2") -> PlacementCosts:
    """``--cost unit``: F = 1, B = 2, I = W = 1, each vocabulary pass 1 (:func:`unit_vocab_times`),
    communication free."""
    table = {F: 1.0, B: 2.0, I: 1.0, W: 1.0, **unit_vocab_times(algorithm)}
    return PlacementCosts(lambda a: table.get(a.kind, 1.0))


class _Placer:
    def __init__(
        self,
        base: Schedule,
        algorithm: str,
        costs: PlacementCosts,
        shift: int,
        vocab_first: bool,
        order: list[tuple[str, int]] | None = None,
    ) -> None:
        self.alg = algorithm
        self.costs = costs
        self.sched = Schedule(
            name=base.name,
            num_ranks=base.num_ranks,
            num_stages=base.num_stages,
            num_microbatches=base.num_microbatches,
            placement=base.placement,
            actions=base.actions,
            kinds=registry(algorithm, base.kinds),
            meta={**base.meta, "vocab_parallel": algorithm},
        )
        p, m = base.num_ranks, base.num_microbatches
        self.p, self.m = p, m
        self.homes = [home(base, r) for r in range(p)]
        self.vocab_first = vocab_first
        self.queue = [
            shift_forwards([a for a in row if a.kind in _COMPUTE_BASE], shift) for row in base.actions
        ]
        self.tail = [[a for a in row if a.kind not in _COMPUTE_BASE] for row in base.actions]
        self.taken = [[False] * len(q) for q in self.queue]
        self.head = [0] * p
        naive = algorithm == "naive"
        steps = _STEPS if naive else tuple(k for k in _STEPS if k != VSM)
        self.next = {kind: [0] * p for kind in steps}
        self.s_first = VSM if naive else VS  # the step X feeds
        self.feeds = {k: c for k, c in _FEEDS.items() if k in steps and not (k == VT and algorithm == "alg2")}
        self.order = order  # one global sequence of vocabulary steps, the same on every rank
        self.pos = [0] * p
        self.starts: dict[tuple[str, int], list[float]] = {}
        self.clock = [0.0] * p
        self.ends: dict[Event, float] = {}
        self.rank_of_event: dict[Event, int] = {}
        self.out: list[list[Action]] = [[] for _ in range(p)]
        self.issued: dict[tuple[str, int], dict[int, float]] = {}  # (kind, k) -> rank -> issue time
        last = base.num_stages - 1
        self.last_rank, self.first_rank = base.placement[last], base.placement[0]
        self.window = p + shift + 1

    # -- event times -------------------------------------------------------------------------------
    def end(self, ev: Event) -> float | None:
        """When event ``ev`` has completed (collectives: their rendezvous end), None if not yet known."""
        hit = self.ends.get(ev)
        if hit is not None or ev[0] not in _COLLECTIVES:
            return hit
        issued = self.issued.get((ev[0], ev[2]), {})
        if len(issued) < self.p:
            return None
        self.ends[ev] = max(issued.values()) + self.costs.collective.get(ev[0], 0.0)
        return self.ends[ev]

    def _issue(self, rank: int, kind: str, k: int) -> None:
        """Rank issues collective ``kind`` of microbatch ``k`` now (non-blocking; a rendezvous)."""
        if k >= self.m:
            return
        self.out[rank].append(Action(self.homes[rank], kind, k))
        self.issued.setdefault((kind, k), {})[rank] = self.clock[rank]

    def ready(self, action: Action, rank: int) -> float | None:
        """Earliest start of ``action`` on ``rank`` from its requirements (None: one is not known)."""
        t = 0.0
        if action.kind in (VBX, VEBC):  # a broadcast is issued once the root's data exists
            stage, kind = (self.sched.num_stages - 1, F) if action.kind == VBX else (0, I)
            return self.ends.get((kind, stage, action.microbatch, None))
        for ev in self.sched.kinds[action.kind].requires(action, self.sched):
            e = self.end(ev)
            if e is None:
                return None
            if ev[0] in _COMPUTE_BASE and self.rank_of_event.get(ev, rank) != rank:
                e += self.costs.p2p
            t = max(t, e)
        return t

    # -- candidates --------------------------------------------------------------------------------
    def _vocab(self, kind: str, rank: int) -> Action | None:
        k = self.next[kind][rank]
        if k >= self.m:
            return None
        if self.order is not None:
            if self.pos[rank] >= len(self.order) or self.order[self.pos[rank]] != (kind, k):
                return None
        elif kind == VEF and k >= self.next[VS][rank] + self.window:
            return None
        elif kind == VBX and k != self.next[self.s_first][rank]:
            return None  # issued right before its S
        elif kind == VEBC and k != self.next[VEB][rank]:
            return None
        return Action(self.homes[rank], kind, k)

    def _base_head(self, rank: int) -> tuple[int, Action] | None:
        q, taken = self.queue[rank], self.taken[rank]
        i = self.head[rank]
        while i < len(q) and taken[i]:
            i += 1
        self.head[rank] = i
        return (i, q[i]) if i < len(q) else None

    def candidates(self, rank: int) -> list[tuple[Action, int | None]]:
        """(action, queue index or None for vocabulary actions) in priority order."""
        out: list[tuple[Action, int | None]] = []
        for kind in (VT, VBX, VS, VSM, VEBC, VEB, VEF):
            a = self._vocab(kind, rank) if kind in self.next else None
            if a is not None:
                out.append((a, None))
        head = self._base_head(rank)
        if head is not None:
            out.insert(0 if not self.vocab_first else len(out), (head[1], head[0]))
        return out

    def work_left(self, rank: int) -> bool:
        return self._base_head(rank) is not None or any(self.next[k][rank] < self.m for k in self.next)

    # -- placing -----------------------------------------------------------------------------------
    def place(self, rank: int, action: Action, index: int | None, start: float) -> None:
        kind, k = action.kind, action.microbatch
        if kind in (VBX, VEBC):
            self._issue(rank, kind, k)
            self.next[kind][rank] += 1
            self.pos[rank] += 1
            self.starts.setdefault((kind, k), []).append(start)
            return
        end = start + float(self.costs.compute(action))
        self.out[rank].append(action)
        if index is None:
            self.next[kind][rank] += 1
            self.pos[rank] += 1
            self.starts.setdefault((kind, k), []).append(start)
        else:
            self.taken[rank][index] = True
        for ev in self.sched.kinds[kind].events(action, self.sched):
            self.ends[ev] = end
            self.rank_of_event[ev] = rank
        self.clock[rank] = end
        if kind in self.feeds:  # the collective this action feeds, issued right after it
            self._issue(rank, self.feeds[kind], k)

    def run(self) -> tuple[Schedule, float]:
        wake: list[float] = list(self.clock)
        while True:
            active = [r for r in range(self.p) if self.work_left(r)]
            if not active:
                break
            rank = min(active, key=lambda r: (wake[r], r))
            if wake[rank] == _INF:
                heads = ", ".join(f"rank {r}: {[str(a) for a, _ in self.candidates(r)]}" for r in active)
                raise ScheduleError(f"{self.sched.name}: vocabulary placement is stuck ({heads})")
            now = max(self.clock[rank], wake[rank])
            best, earliest = None, _INF
            for action, index in self.candidates(rank):
                t = self.ready(action, rank)
                if t is None:
                    continue
                if t <= now:
                    best = (action, index)
                    break
                earliest = min(earliest, t)
            if best is None:
                wake[rank] = earliest
                continue
            self.place(rank, best[0], best[1], now)
            wake = [self.clock[r] if r == rank else self._rewake(r, wake[r]) for r in range(self.p)]
        rows = [out + tail for out, tail in zip(self.out, self.tail, strict=True)]
        return self.sched.with_actions(rows, lowered=False), max(self.clock)

    def global_order(self) -> list[tuple[str, int]]:
        """The vocabulary steps of this (free) pass ordered by their mean start over the ranks."""
        rank_of_kind = {kind: i for i, kind in enumerate(_STEPS)}
        return sorted(
            self.starts, key=lambda s: (sum(self.starts[s]) / len(self.starts[s]), s[1], rank_of_kind[s[0]])
        )

    def _rewake(self, rank: int, wake: float) -> float:
        """After a placement a blocked rank may run earlier: its clock or its earliest known start."""
        if wake <= self.clock[rank]:
            return wake
        earliest = _INF
        for action, _ in self.candidates(rank):
            t = self.ready(action, rank)
            if t is not None:
                earliest = min(earliest, t)
        return max(self.clock[rank], earliest) if earliest < _INF else _INF


def shift_forwards(row: list[Action], shift: int) -> list[Action]:
    """Move every forward ``shift`` positions earlier among the rank's non-forward actions: each other
    action comes after ``shift`` more forwards than in ``row`` (1F1B: ``shift`` more warm-up forwards)."""
    forwards = [a for a in row if a.kind == F]
    out: list[Action] = []
    seen = used = 0
    for a in row:
        if a.kind == F:
            seen += 1
            continue
        need = min(len(forwards), seen + shift)
        out.extend(forwards[used:need])
        used = max(used, need)
        out.append(a)
    out.extend(forwards[used:])
    return out


def insert_vocab(
    schedule: Schedule,
    algorithm: str = "alg2",
    costs: PlacementCosts | None = None,
    extra: int | None = None,
) -> Schedule:
    """``schedule`` (compute-only) with the vocabulary actions of ``algorithm`` placed by ``costs``.

    ``extra``: at most this many more forwards run ahead of the backwards on every rank (activation
    memory of ``extra`` more microbatch-chunks) so the pipeline stays fed while the last stage's
    backward waits for ∇X; default 2 for alg1, 1 for alg2 (the paper's p + 2 and p + 1 on 1F1B), 3 for
    naive (whose S is two passes, ``VSM`` and ``VS``, around the MAX all-reduce ``VCM``). The
    pass tries every shift 0..extra and both priorities (vocabulary passes first, or the schedule's
    next action first) and keeps the shortest iteration on the planning clock (ties: less memory).
    On plain 1F1B with m > p (Algorithms 1 and 2, ``extra`` at least the reference's 2 or 1) the
    reference implementation's order (:func:`.reference_choice.reference_candidate`) is returned instead
    when the simulator, under ``costs``, predicts it no slower (``meta["vocab_order"]``: "reference" or
    "planned"). The result validates with :func:`pipewright.passes.validate.validate`.
    """
    if schedule.lowered:
        raise ScheduleError("insert the vocabulary actions before lowering (pass a compute-only schedule)")
    if algorithm not in DEFAULT_EXTRA:
        raise ScheduleError(f"vocabulary algorithm {algorithm!r}; choose alg1, alg2 or naive")
    allowance = DEFAULT_EXTRA[algorithm] if extra is None else extra
    costs = costs or unit_costs(algorithm)
    best: tuple[float, int, bool, Schedule] | None = None
    stuck: ScheduleError | None = None
    for shift in range(allowance + 1):
        for vocab_first in (True, False):
            try:
                sched, span = place_variant(schedule, algorithm, costs, shift, vocab_first)
            except ScheduleError as err:  # a shift can deadlock a V-shape order (forwards before inputs)
                stuck = stuck or err
                continue
            if best is None or span < best[0] - 1e-9 * max(1.0, span):
                best = (span, shift, vocab_first, sched)
    reference = reference_candidate(schedule, algorithm, costs, allowance)
    if best is None and reference is None:
        raise stuck or ScheduleError("no vocabulary placement")
    if best is None:
        return reference
    planned = replace_meta(best[3], vocab_shift=best[1], vocab_first=best[2], vocab_order="planned")
    if reference is not None:
        ours, theirs = simulated_span(planned, costs), simulated_span(reference, costs)
        if theirs <= ours + 1e-9 * max(1.0, ours):
            return reference
    return planned


def place_variant(
    schedule: Schedule, algorithm: str, costs: PlacementCosts, shift: int, vocab_first: bool
) -> tuple[Schedule, float]:
    """One placement: a free pass fixes one global order of the vocabulary steps (by their mean start
    over the ranks), the second places them in that order on every rank. (schedule, planned span)."""
    free = _Placer(schedule, algorithm, costs, shift, vocab_first)
    free.run()
    return _Placer(schedule, algorithm, costs, shift, vocab_first, free.global_order()).run()


def replace_meta(schedule: Schedule, **meta: object) -> Schedule:
    return schedule.with_actions(schedule.actions, meta={**schedule.meta, **meta})
