"""The fast path's compile over the lowered actions: lowering, dependency resolution, the validator's
checks and compilation of a schedule over integer arrays, with no Python object per lowered action
(when :mod:`pipewright.sim.compute_compile` declines, and for the lowered program it builds on demand).

An action is coded as three integers — stage s, kind c (its index in the schedule's registry) and
microbatch k (−1 for per-stage actions) — and an event ``(kind, s, k, None)`` as the key
``(c·S + s)·(m + 1) + k + 1`` into a table of producers. A kind whose rules are data (a ``template``:
:class:`pipewright.deps.pattern`, :class:`~pipewright.deps.after`, :data:`~pipewright.deps.matching_send`,
the default "produces its own event") is resolved for all its actions at once, term by term; a kind whose
rule is a plain function (the per-stage REDUCE_GRAD and STEP, feature kinds) is asked per action, so
every kind keeps working through the same metadata. Lowering follows the kinds' ``P2P.attach`` exactly as
:func:`pipewright.passes.lower.lower` does, in the same order, over the columns: ``lower`` makes an
``Action`` per lowered action, and it with the columns read back costs about 20 times as much (21.7 ms
against 1.1 ms for interleaved 1F1B p = 16, m = 128, v = 2, 24,064 lowered actions, 2026-12-07).

The compile declines (:class:`~pipewright.sim.array_coding.Decline`), and
:func:`pipewright.sim.engine.simulate` takes the reference path (:mod:`pipewright.sim.reference`), whose
validator names the offending action, for anything unusual: an unknown kind, a payload, an index out
of range, an action on another rank than its stage's, a duplicate action or event, a requirement nothing
produces, an incomplete schedule, an unmatched or misplaced send/receive, a collective across pipeline
ranks. A schedule it accepts passes the validator's checks 1–3; check 4 (it runs to completion) is the
simulation itself, which reports a stuck schedule through the validator.

Costs are asked once per (kind, stage) for compute and per (kind, stage, destination) for transfers, of
the first such action: every microbatch of a stage costs the same (as the reference path assumes for
compute), unless the cost model declares that its compute times vary per action
(:func:`pipewright.sim.array_coding.varies_per_action`: then each compute action's own). Cost models
receive the schedule as given (its shape — stages, placement, kinds — not its lowered action list).
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from pipewright.ir import Action, Schedule
from pipewright.passes.lower import lower
from pipewright.sim.array_coding import (
    INDEX,
    MAX_KEYS,
    Coding,
    Decline,
    attached,
    compute_costs,
    repeats,
    schedule_columns,
    transfer_links,
)
from pipewright.sim.compiled import COLLECTIVE, COMPUTE, RENDEZVOUS, SEND, WAIT, Program, action_mode
from pipewright.sim.fast_loop import compute_steps

if TYPE_CHECKING:
    from pipewright.cost.base import CommModel, CostModel


def _lower(codes: Coding, kc, st, mb, rank, lens):
    """:func:`pipewright.passes.lower.lower` over arrays: receives right before, sends right after each
    action of a kind they attach to, when the peer stage exists and sits on another rank (receives,
    then sends, in registry order). Each action gets a row of slots — receive kinds, itself, send
    kinds —; the used slots, row after row, are the lowered actions."""
    n = len(kc)
    recvs, sends = [], []
    for c, spec, mask in attached(codes, kc, st):
        (recvs if spec.p2p.role == "recv" else sends).append((c, mask))
    slots = [*recvs, (-1, None), *sends]
    kinds = np.empty((n, len(slots)), kc.dtype)
    used = np.empty((n, len(slots)), bool)
    per = np.ones(n, np.int8)  # lowered actions per action (column by column: no row reductions)
    for i, (c, ok) in enumerate(slots):
        kinds[:, i] = kc if ok is None else c
        used[:, i] = True if ok is None else ok
        if ok is not None:
            per += ok
    out_kind = kinds.ravel()[used.ravel()]
    ends = np.zeros(n + 1, np.int64)
    np.cumsum(per, out=ends[1:])
    bounds = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=bounds[1:])
    lens = np.diff(ends[bounds])  # each rank's lowered actions
    rank = np.repeat(np.arange(len(lens), dtype=rank.dtype), lens)
    return (out_kind, np.repeat(st, per), np.repeat(mb, per), rank, lens)


def compile_lowered(schedule: Schedule, cost: CostModel, comm: CommModel, check: bool):
    """``(program, lowered schedule or None)`` of ``schedule`` over the lowered actions' arrays, or
    :class:`~pipewright.sim.array_coding.Decline` (module docstring). ``check``: also the validator's
    completeness and send/receive checks. The lowered schedule is built only when a rule that is a
    plain function needs it."""
    codes = Coding(schedule)
    specs = codes.specs
    kc, st, mb, rank, lens = schedule_columns(schedule, codes)
    used = np.flatnonzero(np.bincount(kc, minlength=len(specs))).tolist()
    if any(specs[c].collective is not None and specs[c].collective.spans_pipeline for c in used):
        raise Decline
    if not schedule.lowered:
        if any(specs[c].p2p is not None for c in used):
            raise Decline  # a compute-only schedule with transfers already in it: per action
        kc, st, mb, rank, lens = _lower(codes, kc, st, mb, rank, lens)
        used = np.flatnonzero(np.bincount(kc, minlength=len(specs))).tolist()
    n_keys = len(specs) * codes.S * (codes.M + 1)
    if n_keys > MAX_KEYS:
        raise Decline
    if repeats(codes.key(kc, st, mb), n_keys):
        raise Decline  # an action twice
    events = _Events(schedule, codes, kc, st, mb, used, n_keys)
    if check:
        _check(schedule, codes, events.producer, events.groups, st, mb, events.lowered)
    modes = np.array([action_mode(s) for s in specs], np.int8)[kc]
    pairs, dest = _requirements(rank, modes, events.rg, events.need, len(kc))
    offsets = [0, *np.cumsum(lens).tolist()]
    sched = events.lowered[0] if events.lowered else schedule
    durs, busy, flops, model_flops, peaks = compute_costs(
        codes, sched, cost, kc, st, mb, rank, modes, offsets
    )
    links, num_links = _transfers(codes, sched, cost, comm, kc, st, mb, rank, modes, dest, durs)
    for g in np.flatnonzero(modes == COLLECTIVE).tolist():
        a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
        coll = specs[kc[g]].collective
        members = coll.participants(a, sched)
        nbytes = cost.message_bytes(a, sched)
        durs[g] = float(comm.collective_time(coll.op, int(rank[g]), nbytes, coll.group, members))
    steps = compute_steps(modes, durs, links, *pairs, offsets, num_links)
    prog = Program(
        offsets, None, None, modes, durs, links, num_links, busy, flops, model_flops, peaks,
        pairs=pairs, steps=steps,
    )  # fmt: skip
    return prog, (events.lowered[0] if events.lowered else None)


class _Events:
    """The events of the lowered actions (columns ``kc``, ``st``, ``mb``; ``used``: the kinds used):
    ``producer``, the action that produces each event key (n: none); the requirements as
    (consumer ``rg``, producer ``need``) arrays in requirement order; ``groups``, the actions of each
    kind; ``lowered``: the lowered schedule in a list once a rule that is a plain function needed it.
    Declines for an event computed twice or a requirement nothing produces."""

    def __init__(self, schedule: Schedule, codes: Coding, kc, st, mb, used: list[int], n_keys: int) -> None:
        self.schedule, self.codes = schedule, codes
        self.lowered: list[Schedule] = []
        self._actions: list[Action] = []
        n = len(kc)
        req_parts, prod_parts = [], []
        self.groups = {c: np.flatnonzero(kc == c) for c in used}
        for c, g in self.groups.items():
            spec = codes.specs[c]
            s, k = st[g], mb[g]
            for rule, parts in ((spec.requires, req_parts), (spec.produces, prod_parts)):
                if rule is None:  # the default: the action's own event
                    parts.append((g, codes.key(c, s, k)))
                    continue
                template = getattr(rule, "template", None)
                if template is None:
                    parts.append(self._per_action(rule, g))
                else:
                    parts.extend(codes.term(t, g, s, k) for t in template(spec))
        pg = np.concatenate([p[0] for p in prod_parts])
        pk = np.concatenate([p[1] for p in prod_parts])
        if repeats(pk, n_keys):
            raise Decline  # an event computed twice
        self.producer = np.full(n_keys, n, INDEX)
        self.producer[pk] = pg
        self.rg = np.concatenate([p[0] for p in req_parts])
        self.need = self.producer[np.concatenate([p[1] for p in req_parts])]
        if (self.need == n).any():
            raise Decline  # a requirement nothing produces

    def _per_action(self, rule, g):
        """(actions, event keys) of a rule that is a plain function, asked of each action ``g``."""
        if not self.lowered:
            self.lowered.append(lower(self.schedule))
            self._actions.extend(chain.from_iterable(self.lowered[0].actions))
        sched, actions = self.lowered[0], self._actions
        gs, keys = [], []
        for i in g.tolist():
            for ev in rule(actions[i], sched):
                gs.append(i)
                keys.append(self.codes.event_key(ev))
        return np.array(gs, np.int64), np.array(keys, np.int64)


def _check(schedule: Schedule, codes: Coding, producer, groups, st, mb, lowered) -> None:
    """The validator's completeness and send/receive checks over the event table (``groups``: the
    actions of each kind used)."""
    specs, S, n, used = codes.specs, codes.S, len(st), groups
    width = S * (codes.M + 1)
    for c, spec in enumerate(specs):
        if spec.complete is None or not (spec.always or c in used):
            continue
        covers = getattr(spec.complete, "covers", None)
        if covers is not None:
            kind = codes.kind(covers())
            block = producer[kind * width : (kind + 1) * width].reshape(S, codes.M + 1)[:, 1:]
            if (block == n).any():
                raise Decline
            continue
        sched = lowered[0] if lowered else lower(schedule)
        if any(producer[codes.event_key(ev)] == n for ev, _ in spec.complete(sched)):
            raise Decline
    for c, g in groups.items():
        p2p = specs[c].p2p
        if p2p is None:
            continue
        peer = st[g] + p2p.offset
        if peer.min() < 0 or peer.max() >= S or (codes.place[peer] == codes.place[st[g]]).any():
            raise Decline
        if p2p.role == "send" and (producer[codes.key(codes.kind(p2p.pair), peer, mb[g])] == n).any():
            raise Decline


def _requirements(rank, modes, rg, need, n):
    """Per action, the producers it waits for — without those of earlier compute/marker actions of its
    own rank, which program order already awaits — as (consumer, producer) arrays in requirement order,
    and each producer's last consumer rank (a send's destination), as
    :func:`pipewright.sim.reference.compile_actions` derives them."""
    own = rank[need] == rank[rg]
    awaited = np.zeros(RENDEZVOUS + 1, bool)
    awaited[[COMPUTE, WAIT]] = True
    keep = ~(own & (need < rg) & awaited[modes[need]])
    rg, need = rg[keep], need[keep]
    # a send's destination: the rank of the last action (by index) on another rank that needs it —
    # the highest such rank, as actions are numbered rank by rank
    dest = np.full(n, -1, INDEX)
    other = ~own[keep]
    by, to = need[other], rank[rg[other]]
    if repeats(by, n):  # an event needed on other ranks by several actions: the last one's
        np.maximum.at(dest, by, to)
    else:  # (the common case: one consumer elsewhere)
        dest[by] = to
    return (rg, need), dest


def _transfers(
    codes: Coding, sched: Schedule, cost: CostModel, comm: CommModel, kc, st, mb, rank, modes, dest, durs
):
    """Each send's link and its transfer time (:func:`pipewright.sim.array_coding.transfer_links`)."""
    links = np.full(len(kc), -1, INDEX)
    sends = np.flatnonzero(modes == SEND)
    if not len(sends):
        return links, 0
    args = (kc[sends], st[sends], mb[sends], rank[sends], dest[sends])
    links[sends], num_links, durs[sends] = transfer_links(codes, sched, cost, comm, *args)
    return links, num_links
