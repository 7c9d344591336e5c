"""The integer coding the fast path's two compiles share (:mod:`pipewright.sim.compute_compile` over the
compute actions, :mod:`pipewright.sim.lowered_compile` over the lowered actions): an action is three
integers — stage s, kind c (its index in the schedule's registry) and microbatch k (−1 for per-stage
actions) — and an event ``(kind, s, k, None)`` the key ``(c·S + s)·(m + 1) + k + 1`` into a table of
producers. Here too: the schedule's columns with their checks, where lowering attaches transfers, and
the costs of compute actions and transfers, asked once per (kind, stage) and (kind, stage, destination)
of the first such action — or, for a cost model that declares its compute times vary per action
(:func:`varies_per_action`), the compute time of every compute action.
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from pipewright.deps import Term
from pipewright.ir import Action, Schedule
from pipewright.sim.compiled import COMPUTE
from pipewright.sim.memory import transient_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from pipewright.cost.base import CommModel, CostModel
    from pipewright.kinds import KindSpec

#: Largest event table (kinds × stages × (microbatches + 1)) the path builds; beyond it, per action.
MAX_KEYS = 1 << 26
#: Integer type of the action columns and indices (every key is below MAX_KEYS, every index below
#: the action count): half the memory of int64, and fewer page faults.
INDEX = np.int32
#: Most lowered actions the fast path takes (indices stay int32).
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


def repeats(keys, size: int) -> bool:
    """Whether some of the non-negative integer ``keys`` (below ``size``) occurs twice."""
    seen = np.zeros(size, bool)
    seen[keys] = True
    return int(np.count_nonzero(seen)) != len(keys)


class Decline(Exception):
    """The schedule is not one for this compile (the next one, or the reference path, decides)."""


class Coding:
    """The integer coding of one schedule: stages S, microbatches m, kinds by registry index."""

    def __init__(self, schedule: Schedule) -> None:
        self.names = list(schedule.kinds)
        self.specs: list[KindSpec] = [schedule.kinds[n] for n in self.names]
        self.code = {n: i for i, n in enumerate(self.names)}
        self.S, self.M = schedule.num_stages, schedule.num_microbatches
        self.place = np.asarray(schedule.placement, dtype=INDEX)

    def kind(self, name: str) -> int:
        c = self.code.get(name)
        if c is None:
            raise Decline
        return c

    def key(self, c, s, k):
        """Event keys of (kind c, stage s, microbatch k); k = −1 for none."""
        return (c * self.S + s) * (self.M + 1) + k + 1

    def event_key(self, event: tuple) -> int:
        kind, s, k, p = event
        if p is not None or type(s) is not int or not 0 <= s < self.S:
            raise Decline
        if k is None:
            k = -1
        elif type(k) is not int or not 0 <= k < self.M:
            raise Decline
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
                raise Decline
            return g, self.key(c, src, k)
        g, s, k, src = g[inside], s[inside], k[inside], src[inside]
        cross = self.place[src] != self.place[s]
        keys = self.key(c, src, k)
        if cross.any():  # (the lowered schedule: the receive)
            keys[cross] = self.key(self.kind(term.receive), s[cross], k[cross])
        return g, keys


def schedule_columns(schedule: Schedule, codes: Coding):
    """Stage, kind code, microbatch and rank of every action, as arrays; the actions per rank."""
    cols = schedule.columns
    if cols is not None:  # a generator's columns: no action objects at all
        try:
            lut = [codes.code[name] for name in cols.kinds]
        except KeyError:
            raise Decline from None
        kc = cols.kind if lut == list(range(len(lut))) else np.array(lut, INDEX)[cols.kind]
        st, mb, lens = cols.stage, cols.microbatch, cols.lens.tolist()
    else:
        kc, st, mb, lens = _action_columns(schedule, codes)
    if not len(kc):
        raise Decline
    if len(kc) > MAX_ACTIONS or len(codes.specs) * codes.S * (codes.M + 1) > MAX_KEYS:
        raise Decline
    rank = np.repeat(np.arange(len(lens), dtype=INDEX), lens)
    if st.min() < 0 or st.max() >= codes.S or mb.min() < -1 or mb.max() >= codes.M:
        raise Decline
    if (codes.place[st] != rank).any():
        raise Decline
    # per_microbatch: 1 must name a microbatch, 0 must not (checked per action only when both occur)
    per_mb = np.array(
        [2 if s.per_microbatch is None else int(s.per_microbatch) for s in codes.specs], np.int8
    )
    given = None if mb.min() >= 0 else False if mb.max() < 0 else mb >= 0
    if given is None or given is False:
        kinds = np.flatnonzero(np.bincount(kc, minlength=len(codes.specs)))
        if (per_mb[kinds] == (0 if given is None else 1)).any():
            raise Decline
    else:
        pm = per_mb[kc]
        if ((pm == 1) & ~given).any() or ((pm == 0) & given).any():
            raise Decline
    kc, st, mb = kc.astype(INDEX, copy=False), st.astype(INDEX, copy=False), mb.astype(INDEX, copy=False)
    return kc, st, mb, rank, np.array(lens, dtype=np.int64)


def _action_columns(schedule: Schedule, codes: Coding):
    """Kind code, stage and microbatch columns of a schedule given as action tuples; the row lengths."""
    lens = [len(row) for row in schedule.actions]
    n = sum(lens)
    if n == 0:
        raise Decline
    flat = list(chain.from_iterable(schedule.actions))
    # one column at a time (itemgetter) — several times faster than zip(*flat) over 10⁵–10⁶ tuples
    mbs = list(map(itemgetter(2), flat))
    if list(map(itemgetter(3), flat)).count(None) != n or -1 in mbs:
        raise Decline
    if None in mbs:
        mbs = [-1 if k is None else k for k in mbs]
    try:
        kc = np.fromiter(map(codes.code.__getitem__, map(itemgetter(1), flat)), np.int64, n)
    except (KeyError, TypeError):
        raise Decline from None
    st, mb = np.array(list(map(itemgetter(0), flat))), np.array(mbs)
    if st.dtype.kind != "i" or mb.dtype.kind != "i":
        raise Decline  # not all integers
    return kc, st, mb, lens


def compute_costs(codes: Coding, sched: Schedule, cost: CostModel, kc, st, mb, rank, modes, offsets):
    """Durations of compute actions; per rank the busy time and the activation peak; FLOPs."""
    durs = np.zeros(len(kc))
    comp = np.flatnonzero(modes == COMPUTE)
    _, inverse, firsts = _dense(kc[comp] * codes.S + st[comp], len(codes.specs) * codes.S)
    table = cost_table(codes, sched, cost, kc, st, mb, comp[firsts].tolist())
    time, flop, model_flop, act = (column[inverse] for column in table[:, :4].T)  # contiguous columns
    if varies_per_action(cost):
        time = action_times(codes, sched, cost, kc, st, mb, comp)
    trans = table[:, 4][inverse] if table[:, 4].any() else None
    durs[comp] = time
    cuts = np.searchsorted(comp, offsets).tolist()

    def columns(lo: int, hi: int):
        return (
            time[lo:hi],
            flop[lo:hi],
            model_flop[lo:hi],
            act[lo:hi],
            None if trans is None else trans[lo:hi],
        )

    return (durs, *cost_sums(codes, sched, cost, columns, cuts))


def varies_per_action(cost: object) -> bool:
    """Whether ``cost`` declares that its compute times differ between the microbatches of one (kind,
    stage, payload): its attribute ``varies_per_action`` is True (a property may decide per instance —
    :class:`pipewright.sim.pair_overlap.PairOverlapCost` when pairs are overlapped). Every simulator
    path then asks ``compute_time`` of each compute action; FLOPs and memory stay per (kind, stage).
    Without the attribute the simulator asks each (kind, stage, payload) once."""
    return getattr(cost, "varies_per_action", False) is True


def action_times(codes: Coding, sched: Schedule, cost: CostModel, kc, st, mb, index):
    """``cost.compute_time`` of each of the actions ``index`` (positions in the columns), one call each,
    as a float64 array (for a cost model that :func:`varies_per_action`)."""
    names = codes.names
    out = np.empty(len(index))
    cols = kc[index].tolist(), st[index].tolist(), mb[index].tolist()
    for i, (c, s, k) in enumerate(zip(*cols, strict=True)):
        out[i] = float(cost.compute_time(Action(s, names[c], None if k < 0 else k, None), sched))
    return out


def cost_table(codes: Coding, sched: Schedule, cost: CostModel, kc, st, mb, firsts: list[int]):
    """(compute time, FLOPs, model FLOPs, activation bytes, transient bytes) of the actions
    ``firsts``, one row each (transient: :func:`~pipewright.sim.memory.transient_of`)."""
    table = np.empty((len(firsts), 5))
    transient = transient_of(cost)
    for i, g in enumerate(firsts):
        a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
        table[i] = (
            float(cost.compute_time(a, sched)),
            float(cost.flops(a, sched)),
            float(cost.model_flops(a, sched)),
            float(cost.activation_bytes(a, sched)),
            transient(a, sched),
        )
    return table


def cost_sums(codes: Coding, sched: Schedule, cost: CostModel, columns: Callable, cuts: list[int]):
    """Per rank the busy time and the memory peak (static bytes + the highest over actions of the
    running sum of activation bytes, or of the sum before the action + its transient), and the FLOPs
    and model FLOPs of the compute actions, ``columns(lo, hi)`` giving (time, FLOPs, model FLOPs,
    activation bytes, transient bytes or None when all are 0) of the actions ``lo`` … ``hi − 1``
    (rank r's: ``cuts[r]`` … ``cuts[r + 1] − 1``) in program order — sequential sums
    (``np.cumsum``; the FLOPs carried from rank to rank), exactly as the reference path adds them.
    Ranks of equal length are summed as the rows of one array (a cumulative sum along a row is as
    sequential)."""
    ranks = len(cuts) - 1
    static = [float(cost.static_bytes(r, sched)) for r in range(ranks)]
    width = cuts[1] - cuts[0] if ranks else 0
    if width and all(cuts[r + 1] - cuts[r] == width for r in range(ranks)):
        time, flop, model_flop, act, trans = columns(0, cuts[-1])
        busy = np.cumsum(time.reshape(ranks, width), axis=1)[:, -1].tolist()
        rows = act.reshape(ranks, width)
        np.cumsum(rows, axis=1, out=rows)  # (in place)
        peaks = _with_transients(rows, trans).tolist()
        peaks = [s + max(0.0, p) for s, p in zip(static, peaks, strict=True)]
        model_flops = None if model_flop is flop else float(np.cumsum(model_flop, out=model_flop)[-1])
        flops = float(np.cumsum(flop, out=flop)[-1])
        return busy, flops, flops if model_flops is None else model_flops, peaks
    busy, peaks = [], []
    flops = model_flops = None
    for r in range(ranks):
        lo, hi = cuts[r], cuts[r + 1]
        if hi == lo:
            busy.append(0.0)
            peaks.append(static[r])
            continue
        time, flop, model_flop, act, trans = columns(lo, hi)
        busy.append(float(np.cumsum(time)[-1]))
        peak = _with_transients(np.cumsum(act)[None, :], trans)[0]
        peaks.append(static[r] + max(0.0, float(peak)))
        flops = _carried_sum(flops, flop)
        model_flops = _carried_sum(model_flops, model_flop)
    return busy, flops or 0.0, model_flops or 0.0, peaks


def _with_transients(running, trans):
    """Per row the highest of the running sums ``running`` (ranks × actions) and of the sum before
    each action + its transient (``trans``, flat in the same order; None: none)."""
    peaks = running.max(axis=1)
    if trans is None or not trans.any():
        return peaks
    before = np.zeros_like(running)
    before[:, 1:] = running[:, :-1]
    before += trans.reshape(running.shape)
    return np.maximum(peaks, before.max(axis=1))


def _carried_sum(total: float | None, values) -> float:
    """``total`` + values[0] + values[1] + …, one addition at a time (None: no total yet)."""
    if total is None:
        return float(np.cumsum(values)[-1])
    return float(np.cumsum(np.concatenate(((total,), values)))[-1])


def cross_table(codes: Coding, spec: KindSpec):
    """A mask over (kind, stage) pairs (``kind·S + stage``): the point-to-point kind ``spec`` attaches
    to that kind (its ``attach``), and its peer stage exists and sits on another rank — where lowering
    places it."""
    stages = np.arange(codes.S)
    peer = stages + spec.p2p.offset
    inside = (peer >= 0) & (peer < codes.S)
    cross = np.zeros(codes.S, bool)
    cross[inside] = codes.place[peer[inside]] != codes.place[stages[inside]]
    table = np.zeros((len(codes.specs), codes.S), bool)
    table[[codes.code[k] for k in spec.p2p.attach if k in codes.code]] = cross
    return table.ravel()


def attached(codes: Coding, kc, st) -> list[tuple[int, KindSpec, object]]:
    """Per point-to-point kind that attaches to some kind: (its code, its spec, a mask of the actions
    lowering places it next to — :func:`cross_table` of each action's kind and stage), in registry
    order."""
    kind_stage = kc * codes.S + st  # one gather per transfer kind from a (kind, stage) table
    return [
        (c, spec, cross_table(codes, spec)[kind_stage])
        for c, spec in enumerate(codes.specs)
        if spec.p2p is not None and any(k in codes.code for k in spec.p2p.attach)
    ]


def transfer_links(codes: Coding, sched: Schedule, cost: CostModel, comm: CommModel, kc, st, mb, src, dest):
    """Of sends in program order (kind codes, stages, microbatches, source ranks, destination ranks −
    −1 when nobody receives them, which then stay on the sender's own link, free): (each send's link —
    one FIFO link per (source rank, destination rank), numbered in order of first use —, the number of
    links, each send's transfer time)."""
    times = np.zeros(len(kc))
    if not len(kc):
        return np.zeros(0, INDEX), 0, times
    dst = np.where(dest < 0, src, dest)
    num_ranks = sched.num_ranks
    num_links, links, _ = _dense(src.astype(np.int64) * num_ranks + dst, num_ranks * num_ranks)
    moving = np.flatnonzero(src != dst)
    if len(moving):
        key = (kc[moving].astype(np.int64) * codes.S + st[moving]) * num_ranks + dst[moving]
        distinct, inverse, firsts = _dense(key, len(codes.specs) * codes.S * num_ranks)
        table = np.empty(distinct)
        for i, g in enumerate(moving[firsts].tolist()):
            a = Action(int(st[g]), codes.names[kc[g]], None if mb[g] < 0 else int(mb[g]), None)
            table[i] = float(comm.p2p_time(int(src[g]), int(dest[g]), cost.message_bytes(a, sched)))
        times[moving] = table[inverse]
    return links.astype(INDEX), num_links, times
