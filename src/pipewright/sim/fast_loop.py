"""The simulator's compute-only loop: one step per compute action, receives and sends folded in.

A lowered schedule whose ranks run groups of the form *receives, one compute action, sends* (what
lowering makes of every compute-only schedule: receives right before, sends right after the action
they serve) is simulated one compute action at a time instead of one lowered action at a time:

- a receive (a marker, ``WAIT``) takes no time; it ends at max(rank clock, its send's end), so the
  compute action after it starts at max(rank clock, the ends of its receives' sends, the ends of its
  own cross-rank requirements) — the same maximum the reference loop takes in two steps;
- a send issued right after compute action c starts at max(end of c, its link's free time) and ends
  ``p2p_time`` later (each directed rank pair a FIFO link, in the sender's program order — the order
  the steps visit them), exactly as in :func:`pipewright.sim.reference.run_iteration`;
- a collective of the rank's own stream (a dp or tp reduction: copies of the rank) is such a send on
  the link ``num_links + rank``, the rank's collective stream: the reference loop starts it at max(the
  rank's clock, the stream's free time) and does not hold the rank either.

The receives' own times (the running maximum of the rank's clock and their sends' ends) are filled in
afterwards over arrays (:func:`expand`). Only max and the same additions in the same order are taken,
so every start and end is bit-for-bit the reference loop's. Anything else — collectives across
pipeline ranks, markers with several requirements, a send or collective with requirements of its own,
a receive not followed by a compute action, negative durations — keeps the reference loop
(:func:`compute_steps` returns None).

**Free transfers** (every send lasts 0, as with unit costs and free communication): a send then ends
when the compute action that issues it ends — its link is never behind its sender, since the link's
last transfer ended at an earlier clock of the same rank (checked at the start of each iteration:
every link's free time is at most its source rank's clock) and a rank's clock never goes back. So
the loop takes one event per compute action (:class:`Folded`: a requirement on a send is one on the
compute action that issues it) and sets each link's free time to its last send's end afterwards;
``t + 0.0`` is ``t``, so the times are again bit-for-bit the reference loop's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from pipewright.sim.compiled import COLLECTIVE, COMPUTE, SEND, WAIT, first_missing, one_or_several

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True)
class Steps:
    """A program in compute-only form. Events are numbered computes first (0 … C − 1, in global
    order), then sends (C … C + S − 1); ``in1[j]`` is the one event compute j waits for (−1 none,
    −2 several: ``in_extra[j]``), :attr:`post1` ``[j]`` the one send issued right after it (−1, −2:
    :attr:`post_extra` ``[j]``, in program order; derived from ``send_step`` when the loop with
    transfers asks). ``dur``/``link`` are per event; ``cuts`` the steps per rank.
    The columns are integer/float64 arrays, which the loop reads through memoryviews (an element read
    costs about what a list's does, and no list of half a million numbers is built)."""

    comp: Any  # global index of each compute action
    sends: Any  # global index of each send
    waits: Any  # global index of each receive/marker
    wait_in: Any  # the event each receive waits for (−1: none)
    cuts: list[int]
    in1: Any
    in_extra: dict[int, tuple[int, ...]]
    dur: Any
    link: Any
    send_step: Any  # the step each send follows
    offsets: list[int]  # of the lowered actions (global index = offsets[rank] + position)
    folded: Folded | None = None  # when every send lasts 0

    @cached_property
    def _posts(self) -> tuple[Any, dict[int, tuple[int, ...]]]:
        count = len(self.comp)
        events = np.arange(count, count + len(self.send_step), dtype=self.send_step.dtype)
        return one_or_several(self.send_step, events, count)

    @property
    def post1(self) -> Any:
        return self._posts[0]

    @property
    def post_extra(self) -> dict[int, tuple[int, ...]]:
        return self._posts[1]

    def lowered_steps(self) -> Steps:
        """The steps over the lowered actions: these."""
        return self


@dataclass(frozen=True)
class FoldedSteps:
    """The folded steps of a schedule compiled from its compute actions
    (:mod:`pipewright.sim.compute_compile`): ``cuts`` and ``dur`` (compute actions only) as
    :class:`Steps`' and the :class:`Folded` form; the steps over the lowered actions come from
    ``lowered.program`` (compiled on first use), for the unfolded loop and for :func:`expand`."""

    cuts: list[int]
    dur: Any
    folded: Folded
    lowered: Any  # pipewright.sim.compute_compile._Lowered

    def lowered_steps(self) -> Steps:
        """The steps over the lowered actions (the lowered program compiled on first call)."""
        return self.lowered.program.steps


@dataclass(frozen=True)
class Folded:
    """The steps with every send folded into the compute action that issues it (free transfers):
    ``in1``/``in_extra`` name compute steps only; ``link_src[l]`` is link l's source rank and
    ``link_last`` the (link, step) of each link's last send."""

    in1: Any
    in_extra: dict[int, tuple[int, ...]]
    link_src: list[int]
    link_last: list[tuple[int, int]]


def compute_steps(modes, durs, links, rg, need, offsets: list[int], num_links: int) -> Steps | None:
    """The compute-only form of a compiled program's arrays (requirements as (consumer, producer)
    pairs, own-rank earlier compute/marker producers already left out), or None when it does not
    apply. A collective of the rank's own stream (dp or tp copies of the rank) is a send on the link
    ``num_links + rank``: issued when its rank reaches it, it starts when its stream is free and does
    not hold the rank — a send's rule (:func:`pipewright.sim.reference.run_iteration`)."""
    n = len(modes)
    is_coll = modes == COLLECTIVE
    is_c, is_s, is_w = modes == COMPUTE, (modes == SEND) | is_coll, modes == WAIT
    if not n or not (is_c | is_s | is_w).all() or not (durs >= 0).all():
        return None
    comp, sends, waits = np.flatnonzero(is_c), np.flatnonzero(is_s), np.flatnonzero(is_w)
    if not len(comp) or is_s[rg].any() or is_w[need].any():
        return None  # a send with requirements, or a marker someone waits for
    starts_row = np.zeros(n + 1, bool)
    starts_row[offsets] = True  # (and the end of the last row)
    # a send follows a compute action or another send of its rank
    if len(sends) and (starts_row[sends].any() or is_w[sends - 1].any()):
        return None
    # a receive is followed by a compute action or another receive of its rank
    if len(waits) and (starts_row[waits + 1].any() or is_s[(waits + 1) % n].any()):
        return None
    by_wait = is_w[rg]
    marked = np.zeros(n, bool)
    marked[rg[by_wait]] = True
    if np.count_nonzero(marked) != np.count_nonzero(by_wait):
        return None  # a marker with several requirements
    count = len(comp)
    if is_coll.any():  # each rank's collective stream: a link after the point-to-point ones
        links = links.copy()
        coll = np.flatnonzero(is_coll)
        links[coll] = num_links + np.searchsorted(offsets, coll, side="right") - 1
    # of a compute action its own step, of a send the step it follows
    step = np.cumsum(is_c, dtype=need.dtype) - 1
    event = step.copy()  # (receives: never an event)
    event[sends] = count + np.arange(len(sends), dtype=step.dtype)
    wait_in = np.full(n, -1, need.dtype)
    wait_in[rg[by_wait]] = event[need[by_wait]]
    in1, in_extra = one_or_several(step[rg] + by_wait, event[need], count)  # a receive: the step after it
    send_step = step[sends]
    folded = None
    if not durs[sends].any():
        folded = _fold(in1, in_extra, send_step, links[sends], sends, offsets, count)
    return Steps(
        comp=comp,
        sends=sends,
        waits=waits,
        wait_in=wait_in[waits],
        cuts=np.searchsorted(comp, offsets).tolist(),
        in1=in1,
        in_extra=in_extra,
        dur=np.concatenate((durs[comp], durs[sends])),
        link=np.concatenate((np.full(count, -1, links.dtype), links[sends])),
        send_step=send_step,
        offsets=offsets,
        folded=folded,
    )


def _fold(in1, in_extra, send_step, send_link, sends, offsets: list[int], count: int) -> Folded:
    """:class:`Folded` of the steps (every send lasts 0): event C + i (send i) becomes send_step[i]."""
    on_send = in1 >= count
    f_in1 = in1.copy()
    f_in1[on_send] = send_step[in1[on_send] - count]
    f_extra = {
        j: tuple(e if e < count else int(send_step[e - count]) for e in events)
        for j, events in in_extra.items()
    }
    src, link_last = _link_lasts(
        send_link, send_step, lambda first: np.searchsorted(offsets, sends[first], side="right") - 1
    )
    return Folded(f_in1, f_extra, src, link_last)


def _link_lasts(send_link, send_step, source: Callable) -> tuple[list[int], list[tuple[int, int]]]:
    """Of sends in program order (their links and the steps they follow): each link's source rank —
    ``source(i)`` of sends i, the first of each link — and (link, step of its last send) per used link
    (:attr:`Folded.link_src`, :attr:`Folded.link_last`)."""
    num_links = int(send_link.max()) + 1 if len(send_link) else 0
    first = np.full(num_links, len(send_link), np.int64)
    last = np.full(num_links, -1, np.int64)
    np.minimum.at(first, send_link, np.arange(len(send_link)))
    np.maximum.at(last, send_link, np.arange(len(send_link)))
    used = np.flatnonzero(last >= 0)
    src = np.zeros(num_links, np.int64)  # every send of a link has the same source rank
    src[used] = source(first[used])
    return src.tolist(), list(zip(used.tolist(), send_step[last[used]].tolist(), strict=True))


def run_steps(steps: Steps, clock: list[float], link_free: list[float]):
    """One iteration from ``clock`` over the steps: (ends per event, clocks, links' free times) or
    None when some rank cannot finish. ``clock`` and ``link_free`` are not changed. Starts are not
    kept: :meth:`StepTimes.expand` derives them (a maximum of ends). With free transfers (and no
    link ahead of its source rank's clock), the ends are those of the compute steps only."""
    fold = steps.folded
    if fold is not None and all(link_free[lk] <= clock[r] for lk, r in enumerate(fold.link_src)):
        return _run_folded(steps, fold, clock, link_free)
    steps = steps.lowered_steps()
    in1, post1 = memoryview(steps.in1), memoryview(steps.post1)
    dur, link = memoryview(steps.dur), memoryview(steps.link)
    in_extra, post_extra, cuts = steps.in_extra, steps.post_extra, steps.cuts
    n_ev = len(dur)
    ends = [-1.0] * (n_ev + 1)
    clock, link_free = list(clock), list(link_free)
    waiter = [-1] * (n_ev + 1)  # the rank blocked on each event (as in _run_folded)
    more: dict[int, list[int]] = {}
    ptr = cuts[:-1]
    ready = list(range(len(clock) - 1, -1, -1))
    while ready:
        r = ready.pop()
        stop, t_rank = cuts[r + 1], clock[r]
        for j in range(ptr[r], stop):
            t = t_rank
            e = in1[j]
            if e >= 0:
                te = ends[e]
                if te < 0.0:
                    if waiter[e] == -1:
                        waiter[e] = r
                    else:
                        _wait(e, r, waiter, more)
                    break
                if te > t:
                    t = te
            elif e == -2:
                e, t = first_missing(in_extra[j], ends, t)
                if e >= 0:
                    _wait(e, r, waiter, more)
                    break
            ends[j] = t_rank = t + dur[j]
            w = waiter[j]
            if w != -1:
                _wake(j, w, ready, more)
            s = post1[j]
            if s >= 0:
                lk = link[s]
                ts = link_free[lk]
                if t_rank > ts:
                    ts = t_rank
                ends[s] = link_free[lk] = ts + dur[s]
                w = waiter[s]
                if w != -1:
                    _wake(s, w, ready, more)
            elif s == -2:  # several sends (rare): the same, one after another
                for s in post_extra[j]:
                    _send(s, t_rank, link, dur, link_free, ends)
                    if waiter[s] != -1:
                        _wake(s, waiter[s], ready, more)
        else:
            j = stop
        ptr[r] = j
        clock[r] = t_rank
    if any(ptr[r] < cuts[r + 1] for r in range(len(clock))):
        return None
    ends.pop()
    return ends, clock, link_free


def _run_folded(steps: Steps, fold: Folded, clock: list[float], link_free: list[float]):
    """:func:`run_steps` with the sends folded into their compute actions (see the module docstring):
    one event per compute step. A blocked rank is kept in ``waiter[e]`` (−1: nobody; −2: several,
    listed in ``more[e]`` — a compute action whose sends go to several ranks). An event not yet ended
    reads +inf, and ``in1`` −1 (no event) and −2 (several) index two slots past the steps, −inf and
    +inf: a step's start is then max(clock, its event's end) with one comparison in the usual case
    (the same maximum, taken in the same order)."""
    in1, dur, in_extra, cuts = memoryview(fold.in1), memoryview(steps.dur), fold.in_extra, steps.cuts
    count = cuts[-1]
    ends = [_UNDONE] * count + [_UNDONE, -_UNDONE]  # [−2]: several events; [−1]: none
    clock = list(clock)
    waiter = [-1] * (count + 1)
    more: dict[int, list[int]] = {}
    ptr = cuts[:-1]
    ready = list(range(len(clock) - 1, -1, -1))
    while ready:
        r = ready.pop()
        stop, t_rank = cuts[r + 1], clock[r]
        for j in range(ptr[r], stop):
            e = in1[j]
            te = ends[e]
            if te > t_rank:
                if te == _UNDONE:
                    if e == -2:  # several events: the first that has not ended, or all ended
                        e, te = _first_undone(in_extra[j], ends, t_rank)
                    if e != -1:
                        if waiter[e] == -1:  # (the usual case: one rank waits for it)
                            waiter[e] = r
                        else:
                            _wait(e, r, waiter, more)
                        break
                ends[j] = t_rank = te + dur[j]
            else:
                ends[j] = t_rank = t_rank + dur[j]
            w = waiter[j]
            if w != -1:
                if w >= 0:
                    ready.append(w)
                else:
                    ready.extend(more.pop(j))
        else:
            j = stop
        ptr[r] = j
        clock[r] = t_rank
    if any(ptr[r] < cuts[r + 1] for r in range(len(clock))):
        return None
    del ends[count:]
    link_free = list(link_free)
    for lk, j in fold.link_last:
        link_free[lk] = ends[j]  # its last send's end: that step's end + 0
    return ends, clock, link_free


#: The end the folded loop reads for an event that has not ended (every real end is finite).
_UNDONE = float("inf")


def _first_undone(events: tuple[int, ...], ends: list[float], t: float) -> tuple[int, float]:
    """Of a step waiting for several ``events`` from clock ``t``: (−1, max of ``t`` and their ends)
    when all have ended, else (the first that has not, ``t``) — :func:`first_missing` for the folded
    loop's +inf."""
    for e in events:
        te = ends[e]
        if te == _UNDONE:
            return e, t
        if te > t:
            t = te
    return -1, t


def _wake(e: int, w: int, ready: list[int], more: dict[int, list[int]]) -> None:
    """Event ``e`` ended: the rank ``w`` blocked on it (−2: the ranks in ``more[e]``) may go on."""
    if w >= 0:
        ready.append(w)
    else:
        ready.extend(more.pop(e))


def _wait(e: int, r: int, waiter: list[int], more: dict[int, list[int]]) -> None:
    """Rank ``r`` waits for event ``e``."""
    w = waiter[e]
    if w == -1:
        waiter[e] = r
    else:
        more.setdefault(e, [] if w == -2 else [w]).append(r)
        waiter[e] = -2


def _send(s: int, t: float, link, dur, link_free: list[float], ends: list[float]) -> None:
    """Send ``s`` issued at ``t``: it starts when its link is free and ends ``dur[s]`` later (what the
    loop does inline for a step's single send)."""
    lk = link[s]
    ts = link_free[lk]
    if t > ts:
        ts = t
    ends[s] = link_free[lk] = ts + dur[s]


@dataclass(frozen=True)
class StepTimes:
    """One iteration's event ends from :func:`run_steps`, expanded to the start and end of every
    lowered action on demand (:meth:`expand`), with the ranks' clocks and the links' free times when
    the iteration began."""

    steps: Steps
    ends: list[float]
    clock0: list[float]
    link_free0: list[float]

    def expand(self) -> tuple[list[float], list[float]]:
        """Start and end of every lowered action by global index."""
        out_s, out_e = expand(self)
        return out_s.tolist(), out_e.tolist()


def expand(times: StepTimes):
    """Start and end of every lowered action (arrays by global index) from the event ends, taking the
    maxima the loop took: a compute action starts at max(its rank's clock — the previous step's end or
    the start clock —, the ends it waits for); a send at max(its compute action's end, the previous
    send's end on its link or the link's free time); a receive's time is the running maximum of its
    rank's start clock, the ends of its rank's earlier compute actions and the ends its rank's
    receives waited for, up to and including its own."""
    steps, clock0 = times.steps.lowered_steps(), times.clock0
    offsets = steps.offsets
    n = offsets[-1]
    e_ev = np.array(times.ends)
    count = len(steps.comp)
    if len(e_ev) == count:  # folded free transfers: a send ends with the step that issues it
        e_ev = np.concatenate((e_ev, e_ev[steps.send_step]))
    comp_end = e_ev[:count]
    prev = np.empty(count)  # the rank's clock before each step
    prev[1:] = comp_end[:-1]
    for r, lo in enumerate(steps.cuts[:-1]):
        if lo < steps.cuts[r + 1]:
            prev[lo] = clock0[r]
    got = steps.in1 >= 0
    waited = np.full(count, -np.inf)
    waited[got] = e_ev[steps.in1[got]]
    for j, events in steps.in_extra.items():
        waited[j] = max(e_ev[e] for e in events)
    out_s, out_e = np.zeros(n), np.zeros(n)
    out_s[steps.comp], out_e[steps.comp] = np.maximum(prev, waited), comp_end
    if len(steps.sends):
        send_end = e_ev[count:]
        send_link = steps.link[count:]
        order = np.argsort(send_link, kind="stable")  # each link's sends in program order
        link = send_link[order]
        before = np.array(times.link_free0)[link]
        same = np.flatnonzero(link[1:] == link[:-1]) + 1
        before[same] = send_end[order[same - 1]]
        free = np.empty(len(order))
        free[order] = before
        out_s[steps.sends] = np.maximum(comp_end[steps.send_step], free)
        out_e[steps.sends] = send_end
    if len(steps.waits):
        got = steps.wait_in >= 0
        vals = np.full(len(steps.waits), -np.inf)
        vals[got] = e_ev[steps.wait_in[got]]
        out_e[steps.waits] = vals  # for the running maximum below; replaced by it
        marks = np.sort(np.concatenate((steps.comp, steps.waits)))
        cuts = np.searchsorted(marks, offsets).tolist()
        running = out_e[marks]
        for r in range(len(offsets) - 1):
            lo, hi = cuts[r], cuts[r + 1]
            if hi > lo:
                running[lo] = max(running[lo], clock0[r])
                np.maximum.accumulate(running[lo:hi], out=running[lo:hi])
        out_e[marks] = running
        out_s[steps.waits] = out_e[steps.waits]
    return out_s, out_e
