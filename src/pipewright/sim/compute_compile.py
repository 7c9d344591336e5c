"""The fast path's first compile: a schedule of compute actions compiled straight to the folded
compute-only loop (:mod:`pipewright.sim.fast_loop`, free transfers), without building its lowered actions.

Lowering (:func:`pipewright.passes.lower.lower`) puts a receive right before and a send right after each
compute action of a kind they attach to whose peer stage sits on another rank. When every send lasts 0,
the compute-only loop takes one event per compute action: a requirement on a send is one on the compute
action it follows, and a receive's wait for its send belongs to the compute action it precedes. So the
loop's inputs follow from the compute actions alone (step j = compute action j, in program order):

- ``pos``: the step of each (kind, stage, microbatch); ``prod``: the step that produces each event;
- a step waits for the producers of its requirements, except earlier steps of its own rank (program
  order awaits them) and a requirement on the receive right before it (a term ``Term(kind, offset,
  receive)`` whose receive kind attaches to the step's kind with the same offset);
- each receive makes the step after it wait for the step its matching send follows — on the peer
  stage, the one compute action of a kind the send attaches to (:func:`_one_of`);
- transfers are counted, numbered onto links and costed per (kind, stage) pair of compute actions
  (:class:`_Links`): a pair of a kind a transfer kind attaches to, whose peer sits on another rank, has
  one transfer per action; a link's first use and last send are a pair's first and last step. Links
  are numbered, and each (send kind, stage, destination) costed through its first send, as
  :mod:`pipewright.sim.lowered_compile` does over the lowered actions.

Anything else declines (:class:`pipewright.sim.array_coding.Decline`) and the lowered compile decides: a
lowered schedule or one with other than compute kinds, a rule that is a plain function, a requirement on
a send or on a receive other than the one right before, a send that needs other than what its action
made, two transfer kinds after one action, a send nobody receives, a send that lasts longer than 0, a
negative duration. What runs is what the lowered path runs, bit for bit: the same maxima and sums of the
same numbers in the same order (tests/test_sim_fast_path.py). The lowered program — every lowered action's
mode, duration and requirements, for timelines and per-action times — is compiled on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from pipewright.deps import Term
from pipewright.ir import Action
from pipewright.sim.array_coding import (
    INDEX,
    MAX_KEYS,
    Coding,
    Decline,
    action_times,
    cost_sums,
    cost_table,
    cross_table,
    schedule_columns,
    varies_per_action,
)
from pipewright.sim.compiled import one_or_several
from pipewright.sim.fast_loop import Folded, FoldedSteps

if TYPE_CHECKING:
    from collections.abc import Callable

    from pipewright.cost.base import CommModel, CostModel
    from pipewright.ir import Schedule
    from pipewright.kinds import KindSpec
    from pipewright.sim.compiled import Program


class _Lowered:
    """The lowered program, compiled on first use (``make()``), shared by the program and its steps."""

    def __init__(self, make: Callable[[], Program]) -> None:
        self._make = make

    @cached_property
    def program(self) -> Program:
        prog = self._make()
        if prog.steps is None:  # the conditions here imply the lowered path's; a mismatch is a bug
            raise RuntimeError("the lowered program of a folded schedule has no compute-only form")
        return prog


@dataclass(frozen=True)
class ComputeProgram:
    """What :func:`pipewright.sim.engine.simulate` reads of a compiled program, from the compute actions:
    the lowered offsets and action count, links, busy time, FLOPs and memory, and the folded steps. Any
    other attribute (modes, durations, requirements of every lowered action; :attr:`listed`) is the
    lowered program's, compiled on first use."""

    offsets: list[int]
    missing: int
    num_links: int
    busy: list[float]
    flops: float
    model_flops: float
    peak_memory: list[float]
    steps: FoldedSteps
    lowered: _Lowered

    @property
    def meets(self) -> dict:
        return {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "lowered":
            raise AttributeError(name)
        return getattr(self.lowered.program, name)


def compile_compute(
    schedule: Schedule, cost: CostModel, comm: CommModel, check: bool, lowered: Callable[[], Program]
) -> ComputeProgram:
    """The :class:`ComputeProgram` of ``schedule`` (see the module docstring), or :class:`Decline`.
    ``check``: the validator's completeness check (the transfers are right by construction). The
    lowered program comes from ``lowered()``, asked on first use."""
    codes = Coding(schedule)
    acts = _actions(schedule, codes)
    n, K, S = len(acts.kc), len(codes.specs), codes.S
    made, prod, of_kind = _producers(codes, acts)
    if check:
        _check_complete(codes, prod, acts.used)
    ks = acts.kc.astype(np.intp)  # (kind, stage) of each action (an index: cast once)
    ks *= S
    ks += acts.st
    first = np.full(K * S, n, INDEX)  # (of the steps' type: ufunc.at's fast path)
    last = np.full(K * S, -1, INDEX)
    np.minimum.at(first, ks, acts.steps)
    np.maximum.at(last, ks, acts.steps)
    links = _Links(codes, first, last, np.bincount(ks, minlength=K * S), len(acts.lens))
    in1, in_extra = _waits(codes, acts, of_kind, prod, made, ks, links)
    num_links, src, link_last, firsts = links.numbered(acts.mb)
    for (c, s, dst), (_, r, k) in firsts.items():  # each (send kind, stage, destination)'s first send
        a = Action(s, codes.names[c], k, None)
        if float(comm.p2p_time(r, dst, cost.message_bytes(a, schedule))) != 0.0:
            raise Decline  # transfers that take time: the lowered path's loop
    cuts = [0, *np.cumsum(acts.lens).tolist()]
    time, busy, flops, model_flops, peaks = _costs(codes, schedule, cost, acts, ks, first, cuts)
    later = _Lowered(lowered)
    folded = FoldedSteps(cuts, time, Folded(in1, in_extra, src, link_last), later)
    per_rank = acts.lens + links.per_rank
    return ComputeProgram(
        [0, *np.cumsum(per_rank).tolist()], int(per_rank.sum()), num_links, busy, flops, model_flops,
        peaks, folded, later,
    )  # fmt: skip


@dataclass(frozen=True)
class _Actions:
    """The compute actions as columns — kind code, stage, microbatch; the actions per rank —, the kinds
    used, each action's (stage, microbatch) key ``local``, its step (its index) and ``pos``: the step
    of each (kind, stage, microbatch)."""

    kc: Any
    st: Any
    mb: Any
    lens: Any
    used: list[int]
    local: Any
    steps: Any
    pos: _ByKind


def _actions(schedule: Schedule, codes: Coding) -> _Actions:
    """:class:`_Actions` of a schedule of compute actions only (else declines), no action twice."""
    K = len(codes.specs)
    if schedule.lowered:
        raise Decline
    kc, st, mb, _, lens = schedule_columns(schedule, codes)
    used = np.flatnonzero(np.bincount(kc, minlength=K)).tolist()
    if not all(codes.specs[c].compute for c in used):
        raise Decline
    width = codes.S * (codes.M + 1)
    if K * width > MAX_KEYS:
        raise Decline
    local = st * (codes.M + 1)  # (stage, microbatch) of each action (in place: fewer fresh pages)
    local += mb
    local += 1
    steps = np.arange(len(kc), dtype=INDEX)
    pos = _ByKind(used, width)  # the compute action of each (kind, stage, microbatch)
    keys = kc - pos.lo
    keys *= width
    keys += local
    pos.put(keys, steps)
    pos.distinct()  # else an action twice
    return _Actions(kc, st, mb, lens, used, local, steps, pos)


def _producers(codes: Coding, acts: _Actions):
    """(per kind used the kinds of events it makes, the step that produces each event, per kind used
    its steps — None: all steps are of that kind); declines for an event made twice."""
    used, local, steps = acts.used, acts.local, acts.steps
    made = _made(codes, used)  # the kinds of events each kind produces
    prod = _ByKind([e for c in used for e in made[c]], codes.S * (codes.M + 1))
    of_kind = {c: None if len(used) == 1 else np.flatnonzero(acts.kc == c) for c in used}  # None: all
    for c in used:
        g = of_kind[c]
        for e in made[c]:
            prod.put(prod.keys(e, local if g is None else local[g]), steps if g is None else g)
    prod.distinct()  # else an event computed twice
    return made, prod, of_kind


def _waits(codes: Coding, acts: _Actions, of_kind, prod: _ByKind, made, ks, links: _Links):
    """(``in1``, ``in_extra``) of the folded steps: the events each step waits for — its kept
    requirements and, for a receive before it, the step its matching send follows; registers the
    sends and receives with ``links``."""
    specs, used, local = codes.specs, acts.used, acts.local
    in_keys, in_events = [], []
    for c in used:
        kept = _kept_requirements(codes, c, of_kind[c], acts.st, local, prod)
        if kept is not None:
            in_keys.append(kept[0])
            in_events.append(kept[1])
    several = bool(in_keys)  # a step may wait for more than one event
    received = np.zeros(len(specs) * codes.S, bool)  # the (kind, stage) pairs with a receive before them
    for c, spec in enumerate(specs):
        if spec.p2p is None or not any(codes.code.get(a) in used for a in spec.p2p.attach):
            continue
        if spec.p2p.role == "send":
            links.add_send(c, spec, made)
            continue
        # a receive before each compute action of an attach kind whose peer sits on another rank: the
        # step after it waits for its matching send (after the action of the send's attach kind there)
        mask = links.attach(spec)
        several |= bool((received & mask).any())
        received |= mask
        g = np.flatnonzero(mask[ks])
        if not len(g):
            continue
        if tuple(_rule(spec.requires, spec) or ()) != (Term(spec.p2p.pair, spec.p2p.offset),):
            raise Decline
        pair = codes.kind(spec.p2p.pair)
        if sum(codes.code.get(a) in used for a in spec.p2p.attach) > 1:
            _one_of(codes, acts.pos, local[g], spec.p2p.attach)  # one receive of a kind there
        in_keys.append(g)
        peer = local[g] + spec.p2p.offset * (codes.M + 1)
        in_events.append(_one_of(codes, acts.pos, peer, specs[pair].p2p.attach))
        links.add_receives(pair, len(g))
    n = len(acts.kc)
    if several:
        return one_or_several(np.concatenate(in_keys), np.concatenate(in_events), n)
    in1 = np.full(n, -1, INDEX)  # (the usual case: each step after at most one receive, no other wait)
    for g, events in zip(in_keys, in_events, strict=True):
        in1[g] = events
    return in1, {}


def _costs(codes: Coding, schedule: Schedule, cost: CostModel, acts: _Actions, ks, first, cuts):
    """(each step's compute time, per rank the busy time, FLOPs, model FLOPs, per rank the memory
    peak): the cost model asked once per (kind, stage) — per action for one whose times vary —,
    summed as :func:`~pipewright.sim.array_coding.cost_sums` sums them."""
    kc, st, mb = acts.kc, acts.st, acts.mb
    present = np.flatnonzero(first < len(kc))
    table = np.zeros((len(codes.specs) * codes.S, 5))
    table[present] = cost_table(codes, schedule, cost, kc, st, mb, first[present].tolist())
    columns = [np.ascontiguousarray(column) for column in table.T]
    time = columns[0][ks]
    if varies_per_action(cost):  # (the F&B pairs' overlap: each compute action's own time)
        time = action_times(codes, schedule, cost, kc, st, mb, acts.steps)
    if (time < 0).any():
        raise Decline

    same = np.array_equal(columns[1], columns[2])  # model FLOPs = FLOPs (no recomputation)
    transients = columns[4].any()

    def rank_columns(lo: int, hi: int):  # (one rank's when ranks differ in length)
        pairs = ks[lo:hi]
        flop = columns[1][pairs]
        trans = columns[4][pairs] if transients else None
        return time[lo:hi], flop, flop if same else columns[2][pairs], columns[3][pairs], trans

    return (time, *cost_sums(codes, schedule, cost, rank_columns, cuts))


class _ByKind:
    """A table over (kind, stage, microbatch) for the kind codes ``min(kinds)`` … ``max(kinds)`` only
    (a kind's block of ``width`` entries, keyed by ``stage·(m + 1) + microbatch + 1``): −1 but where
    :meth:`put`."""

    def __init__(self, kinds: list[int], width: int) -> None:
        self.lo, self.hi, self.width = min(kinds), max(kinds), width
        self.table = np.full((self.hi - self.lo + 1) * width, -1, INDEX)
        self.puts = 0

    def keys(self, kind: int, local):
        """The entries of ``kind`` at the (stage, microbatch) keys ``local`` (a kind in the range)."""
        return local + (kind - self.lo) * self.width

    def put(self, keys, values) -> None:
        """Set the entries ``keys`` to ``values`` (:meth:`distinct` checks that none was set twice)."""
        self.table[keys] = values
        self.puts += len(keys)

    def distinct(self) -> None:
        """Declines when some entry was set twice (fewer entries set than values put)."""
        if np.count_nonzero(self.table >= 0) != self.puts:
            raise Decline

    def get(self, kind: int, local):
        """The entries of ``kind`` at ``local`` (−1 for a kind outside the range)."""
        if not self.lo <= kind <= self.hi:
            return np.full(len(local), -1, INDEX)
        return self.table[self.keys(kind, local)]

    def block(self, kind: int):
        """``kind``'s entries, or None outside the range."""
        if not self.lo <= kind <= self.hi:
            return None
        start = (kind - self.lo) * self.width
        return self.table[start : start + self.width]


def _made(codes: Coding, used: list[int]) -> dict[int, list[int]]:
    """Per kind used, the kinds of the events its actions produce (of its own stage and microbatch)."""
    made = {}
    for c in used:
        spec = codes.specs[c]
        terms = _rule(spec.produces, spec)
        if terms is None:
            made[c] = [c]
            continue
        if any(t.offset != 0 for t in terms):
            raise Decline
        made[c] = [codes.kind(t.kind) for t in terms]
    return made


def _kept_requirements(codes: Coding, c: int, g, st, local, prod: _ByKind):
    """(consumer, producer) steps of the requirements of kind ``c``'s actions ``g`` (None: all) that
    the loop waits for — not earlier compute actions of the same rank, not the receive right before
    the action —, or None for none (the usual case). ``local``: each action's (stage, microbatch) key."""
    spec = codes.specs[c]
    terms = _rule(spec.requires, spec)
    if terms is None:
        raise Decline  # an action that requires its own event
    keep_g, keep_p = [], []
    S, row = codes.S, codes.M + 1
    if g is None:  # every action is of this kind
        g = np.arange(len(st), dtype=INDEX)
    for term in terms:
        e = codes.kind(term.kind)
        if codes.specs[e].p2p is not None or prod.block(e) is None:
            raise Decline  # a requirement on a transfer, or on a kind nothing makes
        if term.offset == 0:  # the same stage: the same rank
            p = prod.get(e, local[g])
            if (p < 0).any():
                raise Decline  # a requirement nothing produces
            later = p >= g  # (its own event: kept, and the loop reports it stuck)
            if later.any():
                keep_g.append(g[later])
                keep_p.append(p[later])
            continue
        if term.receive is None:
            raise Decline
        r = codes.specs[codes.kind(term.receive)].p2p
        if r is None or r.role != "recv" or r.offset != term.offset or spec.name not in r.attach:
            raise Decline  # the receive is not the one right before the action
        stages = np.arange(S)
        src = stages + term.offset
        local_stage = np.zeros(S, bool)  # the source stage exists and sits on the same rank
        ok = (src >= 0) & (src < S)
        local_stage[ok] = codes.place[src[ok]] == codes.place[stages[ok]]
        if not local_stage.any():
            continue  # (loop placement: every source stage on another rank)
        on = local_stage[st[g]]
        if on.any():  # the source stage on the same rank: its producer
            gl = g[on]
            p = prod.get(e, local[gl] + term.offset * row)
            if (p < 0).any():
                raise Decline
            later = p >= gl
            if later.any():
                keep_g.append(gl[later])
                keep_p.append(p[later])
    if not keep_g:
        return None
    return np.concatenate(keep_g), np.concatenate(keep_p)


def _one_of(codes: Coding, pos: _ByKind, local, attach: tuple[str, ...]):
    """At the (stage, microbatch) keys ``local``: the one compute action of a kind in ``attach``
    (declines when there is none or more than one)."""
    found = None
    for name in attach:
        a = codes.code.get(name)
        if a is None or pos.block(a) is None:
            continue
        at = pos.get(a, local)
        if found is None:
            found = at
        elif ((found >= 0) & (at >= 0)).any():
            raise Decline  # two of one kind, stage and microbatch
        else:
            found = np.maximum(found, at)
    if found is None or (found < 0).any():
        raise Decline  # a receive without its send
    return found


class _Links:
    """The transfers, from the (kind, stage) pairs of the compute actions (``first``/``last``/``count``:
    the first and last step and the number of the actions of each pair): which pairs a send or receive
    kind attaches to (the peer stage on another rank), the transfers per rank, each send's link — one
    FIFO link per (source rank, destination rank), numbered in order of first use as the lowered path
    numbers them — and each link's last send."""

    def __init__(self, codes: Coding, first, last, count, ranks: int) -> None:
        self.codes, self.first, self.last, self.count = codes, first, last, count
        self.sends: list[tuple[int, object]] = []  # (send kind, mask over (kind, stage))
        self.received: dict[int, int] = {}  # send kind -> receives that wait for one
        self.per_rank = np.zeros(ranks, np.int64)

    def attach(self, spec: KindSpec):
        """:func:`pipewright.sim.array_coding.cross_table` of ``spec`` over the pairs present; counts the
        transfers on their ranks."""
        mask = cross_table(self.codes, spec) & (self.last >= 0)
        on = np.flatnonzero(mask)
        weights = self.count[on]
        self.per_rank += np.bincount(self.codes.place[on % self.codes.S], weights, len(self.per_rank)).astype(
            np.int64
        )
        return mask

    def add_send(self, c: int, spec: KindSpec, made: dict[int, list[int]]) -> None:
        """A send kind; it must require only what the action it follows made (else declines)."""
        mask = self.attach(spec)
        kinds = np.flatnonzero(mask.reshape(len(self.codes.specs), -1).any(axis=1)).tolist()
        for term in _rule(spec.requires, spec) or ():
            need = self.codes.kind(term.kind)
            if term.offset != 0 or any(need not in made.get(a, ()) for a in kinds):
                raise Decline  # a send that waits for other than the action it follows
        if any((m & mask).any() for _, m in self.sends):
            raise Decline  # two sends after one action
        self.sends.append((c, mask))

    def add_receives(self, send_kind: int, count: int) -> None:
        """``count`` receives wait for (distinct) sends of ``send_kind``."""
        self.received[send_kind] = self.received.get(send_kind, 0) + count

    def numbered(self, mb):
        """(number of links, each link's source rank, (link, step of its last send) per link, and per
        (send kind, stage, destination rank) its first send's step, source rank and microbatch).
        Declines when a send has no receive."""
        codes, S = self.codes, self.codes.S
        groups = []  # (first step, last step, send kind, stage, source, destination)
        for c, mask in self.sends:
            on = np.flatnonzero(mask)
            if int(self.count[on].sum()) != self.received.get(c, 0):
                raise Decline  # a send nobody receives (the lowered path decides)
            peer = codes.specs[c].p2p.offset
            for ks in on.tolist():
                s = ks % S
                groups.append((int(self.first[ks]), int(self.last[ks]), c, s, int(codes.place[s]),
                               int(codes.place[s + peer])))  # fmt: skip
        groups.sort()
        ids: dict[tuple[int, int], int] = {}
        src: list[int] = []
        last: dict[int, int] = {}
        firsts: dict[tuple[int, int, int], tuple[int, int, int | None]] = {}
        for lo, hi, c, s, a, b in groups:
            link = ids.setdefault((a, b), len(ids))
            if link == len(src):
                src.append(a)
            last[link] = max(last.get(link, -1), hi)
            firsts.setdefault((c, s, b), (lo, a, None if mb[lo] < 0 else int(mb[lo])))
        return len(ids), src, sorted(last.items()), firsts


def _rule(rule, spec: KindSpec) -> tuple[Term, ...] | None:
    """The terms of kind ``spec``'s ``rule`` written as data, None for the default (its own event); a
    plain function declines."""
    if rule is None:
        return None
    template = getattr(rule, "template", None)
    if template is None:
        raise Decline
    return template(spec)


def _check_complete(codes: Coding, prod: _ByKind, used: list[int]) -> None:
    """The validator's completeness check: every (stage, microbatch) has the event a rule covers."""
    for c, spec in enumerate(codes.specs):
        if spec.complete is None or not (spec.always or c in used):
            continue
        covers = getattr(spec.complete, "covers", None)
        if covers is None:
            raise Decline
        block = prod.block(codes.kind(covers()))
        if block is None or (block.reshape(codes.S, codes.M + 1)[:, 1:] < 0).any():
            raise Decline
