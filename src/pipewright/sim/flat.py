"""The simulator's array path: lowering, dependency resolution, the validator's checks and compilation
of a schedule over integer arrays, with no Python object per lowered action.

An action is coded as three integers — stage s, kind c (its index in the schedule's registry) and
microbatch k (−1 for per-stage actions) — and an event ``(kind, s, k, None)`` as the key
``(c·S + s)·(m + 1) + k + 1`` into a table of producers. A kind whose rules are data (a ``template``:
:class:`pipewright.deps.pattern`, :class:`~pipewright.deps.after`, :data:`~pipewright.deps.matching_send`,
the default "produces its own event") is resolved for all its actions at once, term by term; a kind whose
rule is a plain function (the per-stage REDUCE_GRAD and STEP, feature kinds) is asked per action, so
every kind keeps working through the same metadata. Lowering follows the kinds' ``P2P.attach`` exactly as
:func:`pipewright.passes.lower.lower` does, in the same order.

The path declines (returns None), and :func:`pipewright.sim.engine.simulate` takes the per-action path
whose validator names the offending action, for anything unusual: an unknown kind, a payload, an index out
of range, an action on another rank than its stage's, a duplicate action or event, a requirement nothing
produces, an incomplete schedule, an unmatched or misplaced send/receive, a collective across pipeline
ranks. A schedule it accepts passes the validator's checks 1–3; check 4 (it runs to completion) is the
simulation itself, which reports a stuck schedule through the validator.

Costs are asked once per (kind, stage) for compute and per (kind, stage, destination) for transfers, of
the first such action: every microbatch of a stage costs the same (as the per-action path assumes for
compute). Cost models receive the schedule as given (its shape — stages, placement, kinds — not its
lowered action list).
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from pipewright.deps import Term
from pipewright.ir import Action, Schedule
from pipewright.passes.lower import lower
from pipewright.sim.program import _COLLECTIVE, _COMPUTE, _RENDEZVOUS, _SEND, _WAIT, _mode, _Program
from pipewright.sim.steps import compute_steps

if TYPE_CHECKING:
    from pipewright.cost.base import CommModel, CostModel
    from pipewright.kinds import KindSpec

#: Largest event table (kinds × stages × (microbatches + 1)) the path builds; beyond it, per action.
MAX_KEYS = 1 << 26
#: Integer type of the action columns and indices (every key is below MAX_KEYS, every index below
#: the action count): half the memory of int64, and fewer page faults.
INDEX = np.int32
#: Most lowered actions the array path takes (indices stay int32).
MAX_ACTIONS = 1 << 28


def _dense(keys, size: int):
    """Of non-negative integer ``keys`` below ``size``: (the number of distinct keys, each element's
    index among them in order of first occurrence, the position of each distinct key's first element)
    — ``np.unique`` without sorting the elements (and without importing numpy.ma)."""
    n = len(keys)
    first = np.full(size, n, np.int64)
    np.minimum.at(first, keys, np.arange(n))
    firsts = np.sort(first[first < n])
    index = np.empty(size, np.int64)
    index[keys[firsts]] = np.arange(len(firsts))
    return len(firsts), index[keys], firsts


def _repeats(keys, size: int) -> bool:
    """Whether some of the non-negative integer ``keys`` (below ``size``) occurs twice."""
    seen = np.zeros(size, bool)
    seen[keys] = True
    return int(np.count_nonzero(seen)) != len(keys)


class _Decline(Exception):
    """The schedule is not one for the array path (the per-action path decides)."""


class _Codes:
    """The integer coding of one schedule: stages S, microbatches m, kinds by registry index."""

    def __init__(self, schedule: Schedule) -> None:
        self.names = list(schedule.kinds)
        self.specs: list[KindSpec] = [schedule.kinds[n] for n in self.names]
        self.code = {n: i for i, n in enumerate(self.names)}
        self.S, self.M = schedule.num_stages, schedule.num_microbatches
        self.place = np.asarray(schedule.placement, dtype=np.int64)

    def kind(self, name: str) -> int:
        c = self.code.get(name)
        if c is None:
            raise _Decline
        return c

    def key(self, c, s, k):
        """Event keys of (kind c, stage s, microbatch k); k = −1 for none."""
        return (c * self.S + s) * (self.M + 1) + k + 1

    def event_key(self, event: tuple) -> int:
        kind, s, k, p = event
        if p is not None or type(s) is not int or not 0 <= s < self.S:
            raise _Decline
        if k is None:
            k = -1
        elif type(k) is not int or not 0 <= k < self.M:
            raise _Decline
        return self.key(self.kind(kind), s, k)

    def term(self, term: Term, g, s, k):
        """Term ``term`` of the actions ``g`` (stages ``s``, microbatches ``k``): (g, event keys)."""
        c = self.kind(term.kind)
        if term.offset == 0:
            return g, self.key(c, s, k)
        src = s + term.offset
        inside = (src >= 0) & (src < self.S)
        if term.receive is None:  # unconditional: a receive's matching send
            if not inside.all():
                raise _Decline
            return g, self.key(c, src, k)
        g, s, k, src = g[inside], s[inside], k[inside], src[inside]
        cross = self.place[src] != self.place[s]
        keys = self.key(c, src, k)
        if cross.any():  # the array path works on the lowered schedule
            keys[cross] = self.key(self.kind(term.receive), s[cross], k[cross])
        return g, keys


def compile_flat(
    schedule: Schedule, cost: CostModel, comm: CommModel, *, check: bool = True
) -> tuple[_Program, Schedule | None] | None:
    """``(program, lowered schedule or None)`` of ``schedule`` (lowered here if it is not), or None when
    the array path declines. ``check``: also the validator's completeness and send/receive checks. The
    lowered schedule is returned only when a per-action rule made it necessary (else it is built on
    demand, see :attr:`pipewright.sim.engine.SimResult.schedule`)."""
    try:
        return _compile_flat(schedule, cost, comm, check)
    except _Decline:
        return None


def _columns(schedule: Schedule, codes: _Codes):
    """Stage, kind code, microbatch and rank of every action, as arrays; the actions per rank."""
    cols = schedule.columns
    if cols is not None:  # a generator's columns: no action objects at all
        try:
            lut = np.array([codes.code[name] for name in cols.kinds], INDEX)
        except KeyError:
            raise _Decline from None
        kc, st, mb, lens = lut[cols.kind], cols.stage, cols.microbatch, cols.lens.tolist()
    else:
        kc, st, mb, lens = _action_columns(schedule, codes)
    if not len(kc):
        raise _Decline
    if len(kc) > MAX_ACTIONS or len(codes.specs) * codes.S * (codes.M + 1) > MAX_KEYS:
        raise _Decline
    rank = np.repeat(np.arange(len(lens), dtype=INDEX), lens)
    if st.min() < 0 or st.max() >= codes.S or mb.min() < -1 or mb.max() >= codes.M:
        raise _Decline
    if (codes.place[st] != rank).any():
        raise _Decline
    per_mb = np.array([2 if s.per_microbatch is None else int(s.per_microbatch) for s in codes.specs])
    pm, given = per_mb[kc], mb >= 0
    if ((pm == 1) & ~given).any() or ((pm == 0) & given).any():
        raise _Decline
    kc, st, mb = kc.astype(INDEX, copy=False), st.astype(INDEX, copy=False), mb.astype(INDEX, copy=False)
    return kc, st, mb, rank, np.array(lens, dtype=np.int64)


def _action_columns(schedule: Schedule, codes: _Codes):
    """Kind code, stage and microbatch columns of a schedule given as action tuples; the row lengths."""
    lens = [len(row) for row in schedule.actions]
    n = sum(lens)
    if n == 0:
        raise _Decline
    flat = list(chain.from_iterable(schedule.actions))
    # one column at a time (itemgetter) — several times faster than zip(*flat) over 10⁵–10⁶ tuples
    mbs = list(map(itemgetter(2), flat))
    if list(map(itemgetter(3), flat)).count(None) != n or -1 in mbs:
        raise _Decline
    if None in mbs:
        mbs = [-1 if k is None else k for k in mbs]
    try:
        kc = np.fromiter(map(codes.code.__getitem__, map(itemgetter(1), flat)), np.int64, n)
    except (KeyError, TypeError):
        raise _Decline from None
    st, mb = np.array(list(map(itemgetter(0), flat))), np.array(mbs)
    if st.dtype.kind != "i" or mb.dtype.kind != "i":
        raise _Decline  # not all integers
    return kc, st, mb, lens


def _lower(codes: _Codes, kc, st, mb, rank, lens):
    """:func:`pipewright.passes.lower.lower` over arrays: receives right before, sends right after each
    action of a kind they attach to, when the peer stage exists and sits on another rank (receives,
    then sends, in registry order). Each action gets a row of slots — receive kinds, itself, send
    kinds —; the used slots, row after row, are the lowered actions."""
    n = len(kc)
    stages = np.arange(codes.S)
    kind_stage = kc * codes.S + st  # one gather per transfer kind from a (kind, stage) table
    recvs, sends = [], []
    for c, spec in enumerate(codes.specs):
        if spec.p2p is None:
            continue
        attach = [codes.code[k] for k in spec.p2p.attach if k in codes.code]
        if not attach:
            continue
        peer = stages + spec.p2p.offset
        inside = (peer >= 0) & (peer < codes.S)
        cross = np.zeros(codes.S, bool)
        cross[inside] = codes.place[peer[inside]] != codes.place[stages[inside]]
        table = np.zeros((len(codes.specs), codes.S), bool)
        table[attach] = cross
        (recvs if spec.p2p.role == "recv" else sends).append((c, table.ravel()[kind_stage]))
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


def _compile_flat(schedule: Schedule, cost: CostModel, comm: CommModel, check: bool):
    codes = _Codes(schedule)
    specs, S = codes.specs, codes.S
    kc, st, mb, rank, lens = _columns(schedule, codes)
    used = np.flatnonzero(np.bincount(kc, minlength=len(specs))).tolist()
    if any(specs[c].collective is not None and specs[c].collective.spans_pipeline for c in used):
        raise _Decline
    if not schedule.lowered:
        if any(specs[c].p2p is not None for c in used):
            raise _Decline  # a compute-only schedule with transfers already in it: per action
        kc, st, mb, rank, lens = _lower(codes, kc, st, mb, rank, lens)
        used = np.flatnonzero(np.bincount(kc, minlength=len(specs))).tolist()
    n = len(kc)
    n_keys = len(specs) * S * (codes.M + 1)
    if n_keys > MAX_KEYS:
        raise _Decline
    if _repeats(codes.key(kc, st, mb), n_keys):
        raise _Decline  # an action twice

    lowered: list[Schedule] = []  # built only for rules that are plain functions
    actions: list[Action] = []

    def per_action(rule, g):
        if not lowered:
            lowered.append(lower(schedule))
            actions.extend(chain.from_iterable(lowered[0].actions))
        sched = lowered[0]
        gs, keys = [], []
        for i in g.tolist():
            for ev in rule(actions[i], sched):
                gs.append(i)
                keys.append(codes.event_key(ev))
        return np.array(gs, np.int64), np.array(keys, np.int64)

    req_parts, prod_parts = [], []
    groups = {c: np.flatnonzero(kc == c) for c in used}  # the actions of each kind
    for c, g in groups.items():
        spec = specs[c]
        s, k = st[g], mb[g]
        for rule, parts in ((spec.requires, req_parts), (spec.produces, prod_parts)):
            if rule is None:  # the default: the action's own event
                parts.append((g, codes.key(c, s, k)))
                continue
            template = getattr(rule, "template", None)
            if template is None:
                parts.append(per_action(rule, g))
            else:
                parts.extend(codes.term(t, g, s, k) for t in template(spec))

    pg = np.concatenate([p[0] for p in prod_parts])
    pk = np.concatenate([p[1] for p in prod_parts])
    if _repeats(pk, n_keys):
        raise _Decline  # an event computed twice
    producer = np.full(n_keys, n, INDEX)
    producer[pk] = pg
    rg = np.concatenate([p[0] for p in req_parts])
    need = producer[np.concatenate([p[1] for p in req_parts])]
    if (need == n).any():
        raise _Decline  # a requirement nothing produces
    if check:
        _check(schedule, codes, producer, groups, st, mb, lowered)

    modes = np.array([_mode(s) for s in specs], np.int8)[kc]
    pairs, dest = _requirements(rank, modes, rg, need, n)
    offsets = [0, *np.cumsum(lens).tolist()]
    sched = lowered[0] if lowered else schedule
    durs, busy, flops, model_flops, peaks = _compute_costs(
        codes, sched, cost, kc, st, mb, rank, modes, offsets
    )
    links, num_links = _transfers(codes, sched, cost, comm, kc, st, mb, rank, modes, dest, durs)
    for g in np.flatnonzero(modes == _COLLECTIVE).tolist():
        a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
        coll = specs[kc[g]].collective
        members = coll.participants(a, sched)
        nbytes = cost.message_bytes(a, sched)
        durs[g] = float(comm.collective_time(coll.op, int(rank[g]), nbytes, coll.group, members))
    steps = compute_steps(modes, durs, links, *pairs, offsets)
    prog = _Program(
        offsets, None, None, modes, durs, links, num_links, busy, flops, model_flops, peaks,
        pairs=pairs, steps=steps,
    )  # fmt: skip
    return prog, (lowered[0] if lowered else None)


def _check(schedule: Schedule, codes: _Codes, producer, groups, st, mb, lowered) -> None:
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
                raise _Decline
            continue
        sched = lowered[0] if lowered else lower(schedule)
        if any(producer[codes.event_key(ev)] == n for ev, _ in spec.complete(sched)):
            raise _Decline
    for c, g in groups.items():
        p2p = specs[c].p2p
        if p2p is None:
            continue
        peer = st[g] + p2p.offset
        if peer.min() < 0 or peer.max() >= S or (codes.place[peer] == codes.place[st[g]]).any():
            raise _Decline
        if p2p.role == "send" and (producer[codes.key(codes.kind(p2p.pair), peer, mb[g])] == n).any():
            raise _Decline


def _requirements(rank, modes, rg, need, n):
    """Per action, the producers it waits for — without those of earlier compute/marker actions of its
    own rank, which program order already awaits — as (consumer, producer) arrays in requirement order,
    and each producer's last consumer rank (a send's destination), as
    :func:`pipewright.sim.per_action.compile_actions` derives them."""
    own = rank[need] == rank[rg]
    awaited = np.zeros(_RENDEZVOUS + 1, bool)
    awaited[[_COMPUTE, _WAIT]] = True
    keep = ~(own & (need < rg) & awaited[modes[need]])
    rg, need = rg[keep], need[keep]
    # a send's destination: the rank of the last action (by index) on another rank that needs it —
    # the highest such rank, as actions are numbered rank by rank
    dest = np.full(n, -1, INDEX)
    other = ~own[keep]
    by, to = need[other], rank[rg[other]]
    if _repeats(by, n):  # an event needed on other ranks by several actions: the last one's
        np.maximum.at(dest, by, to)
    else:  # (the common case: one consumer elsewhere)
        dest[by] = to
    return (rg, need), dest


def _compute_costs(codes: _Codes, sched: Schedule, cost: CostModel, kc, st, mb, rank, modes, offsets):
    """Durations of compute actions; per rank the busy time and the activation peak; FLOPs."""
    durs = np.zeros(len(kc))
    comp = np.flatnonzero(modes == _COMPUTE)
    distinct, inverse, firsts = _dense(kc[comp] * codes.S + st[comp], len(codes.specs) * codes.S)
    table = np.empty((distinct, 4))
    for i, g in enumerate(comp[firsts].tolist()):
        a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
        table[i] = (
            float(cost.compute_time(a, sched)),
            float(cost.flops(a, sched)),
            float(cost.model_flops(a, sched)),
            float(cost.activation_bytes(a, sched)),
        )
    time, flop, model_flop, act = (column[inverse] for column in table.T)  # contiguous columns
    durs[comp] = time
    cuts = np.searchsorted(comp, offsets).tolist()
    busy, peaks = [], []
    for r in range(len(offsets) - 1):
        lo, hi = cuts[r], cuts[r + 1]
        # sequential sums (np.cumsum), exactly as the per-action path adds them
        busy.append(float(np.cumsum(time[lo:hi])[-1]) if hi > lo else 0.0)
        peak = max(0.0, float(np.cumsum(act[lo:hi]).max())) if hi > lo else 0.0
        peaks.append(float(cost.static_bytes(r, sched)) + peak)
    flops = float(np.cumsum(flop)[-1]) if len(comp) else 0.0
    model_flops = float(np.cumsum(model_flop)[-1]) if len(comp) else 0.0
    return durs, busy, flops, model_flops, peaks


def _transfers(
    codes: _Codes, sched: Schedule, cost: CostModel, comm: CommModel, kc, st, mb, rank, modes, dest, durs
):
    """Each send's link — one FIFO link per (source rank, destination rank), numbered in order of first
    use — and its transfer time (sends nobody receives stay on the sender's own link, free)."""
    links = np.full(len(kc), -1, INDEX)
    sends = np.flatnonzero(modes == _SEND)
    if not len(sends):
        return links, 0
    src = rank[sends]
    dst = np.where(dest[sends] < 0, src, dest[sends])
    num_ranks = sched.num_ranks
    num_links, links[sends], _ = _dense(src.astype(np.int64) * num_ranks + dst, num_ranks * num_ranks)
    moving = sends[src != dst]
    if len(moving):
        key = (kc[moving].astype(np.int64) * codes.S + st[moving]) * num_ranks + dst[src != dst]
        distinct, inverse, firsts = _dense(key, len(codes.specs) * codes.S * num_ranks)
        times = np.empty(distinct)
        for i, g in enumerate(moving[firsts].tolist()):
            a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
            times[i] = float(comm.p2p_time(int(rank[g]), int(dest[g]), cost.message_bytes(a, sched)))
        durs[moving] = times[inverse]
    return links, num_links
