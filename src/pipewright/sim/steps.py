"""The simulator's compute-only loop: one step per compute action, receives and sends folded in.

A lowered schedule whose ranks run groups of the form *receives, one compute action, sends* (what
lowering makes of every compute-only schedule: receives right before, sends right after the action
they serve) is simulated one compute action at a time instead of one lowered action at a time:

- a receive (a marker, ``_WAIT``) takes no time; it ends at max(rank clock, its send's end), so the
  compute action after it starts at max(rank clock, the ends of its receives' sends, the ends of its
  own cross-rank requirements) — the same maximum the per-action loop takes in two steps;
- a send issued right after compute action c starts at max(end of c, its link's free time) and ends
  ``p2p_time`` later (each directed rank pair a FIFO link, in the sender's program order — the order
  the steps visit them), exactly as in :func:`pipewright.sim.engine._run_iteration`.

The receives' own times (the running maximum of the rank's clock and their sends' ends) are filled in
afterwards over arrays (:func:`expand`). Only max and the same additions in the same order are taken,
so every start and end is bit-for-bit the per-action loop's. Anything else — collectives, markers
with several requirements, a send with requirements of its own, a receive not followed by a compute
action, negative durations — keeps the per-action loop (:func:`compute_steps` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipewright.sim.program import _COMPUTE, _SEND, _WAIT, first_missing, one_or_several


@dataclass(frozen=True)
class Steps:
    """A program in compute-only form. Events are numbered computes first (0 … C − 1, in global
    order), then sends (C … C + S − 1); ``in1[j]`` is the one event compute j waits for (−1 none,
    −2 several: ``in_extra[j]``), ``post1[j]`` the one send issued right after it (−1, −2:
    ``post_extra[j]``, in program order). ``dur``/``link`` are per event; ``cuts`` the steps per rank.
    The columns are integer/float64 arrays, which the loop reads through memoryviews (an element read
    costs about what a list's does, and no list of half a million numbers is built)."""

    comp: Any  # global index of each compute action
    sends: Any  # global index of each send
    waits: Any  # global index of each receive/marker
    wait_in: Any  # the event each receive waits for (−1: none)
    cuts: list[int]
    in1: Any
    in_extra: dict[int, tuple[int, ...]]
    post1: Any
    post_extra: dict[int, tuple[int, ...]]
    dur: Any
    link: Any
    send_step: Any  # the step each send follows
    offsets: list[int]  # of the lowered actions (global index = offsets[rank] + position)


def compute_steps(modes, durs, links, rg, need, offsets: list[int]) -> Steps | None:
    """The compute-only form of a compiled program's arrays (requirements as (consumer, producer)
    pairs, own-rank earlier compute/marker producers already left out), or None when it does not
    apply."""
    n = len(modes)
    is_c, is_s, is_w = modes == _COMPUTE, modes == _SEND, modes == _WAIT
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
    # of a compute action its own step, of a send the step it follows
    step = np.cumsum(is_c, dtype=need.dtype) - 1
    event = step.copy()  # (receives: never an event)
    event[sends] = count + np.arange(len(sends), dtype=step.dtype)
    wait_in = np.full(n, -1, need.dtype)
    wait_in[rg[by_wait]] = event[need[by_wait]]
    in1, in_extra = one_or_several(step[rg] + by_wait, event[need], count)  # a receive: the step after it
    send_step = step[sends]
    post1, post_extra = one_or_several(send_step, event[sends], count)
    return Steps(
        comp=comp,
        sends=sends,
        waits=waits,
        wait_in=wait_in[waits],
        cuts=np.searchsorted(comp, offsets).tolist(),
        in1=in1,
        in_extra=in_extra,
        post1=post1,
        post_extra=post_extra,
        dur=np.concatenate((durs[comp], durs[sends])),
        link=np.concatenate((np.full(count, -1, links.dtype), links[sends])),
        send_step=send_step,
        offsets=offsets,
    )


def run_steps(steps: Steps, clock: list[float], link_free: list[float]):
    """One iteration from ``clock`` over the steps: (ends per event, clocks, links' free times) or
    None when some rank cannot finish. ``clock`` and ``link_free`` are not changed. Starts are not
    kept: :meth:`StepTimes.expand` derives them (a maximum of ends)."""
    in1, post1 = memoryview(steps.in1), memoryview(steps.post1)
    dur, link = memoryview(steps.dur), memoryview(steps.link)
    in_extra, post_extra, cuts = steps.in_extra, steps.post_extra, steps.cuts
    n_ev = len(dur)
    ends = [-1.0] * (n_ev + 1)
    clock, link_free = list(clock), list(link_free)
    waiting: dict[int, list[int]] = {}
    awaited = bytearray(n_ev + 1)
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
                    waiting.setdefault(e, []).append(r)
                    awaited[e] = 1
                    break
                if te > t:
                    t = te
            elif e == -2:
                e, t = first_missing(in_extra[j], ends, t)
                if e >= 0:
                    waiting.setdefault(e, []).append(r)
                    awaited[e] = 1
                    break
            ends[j] = t_rank = t + dur[j]
            if awaited[j]:
                ready.extend(waiting.pop(j))
            s = post1[j]
            if s >= 0:
                lk = link[s]
                ts = link_free[lk]
                if t_rank > ts:
                    ts = t_rank
                ends[s] = link_free[lk] = ts + dur[s]
                if awaited[s]:
                    ready.extend(waiting.pop(s))
            elif s == -2:  # several sends (rare): the same, one after another
                for s in post_extra[j]:
                    _send(s, t_rank, link, dur, link_free, ends)
                    if awaited[s]:
                        ready.extend(waiting.pop(s))
        else:
            j = stop
        ptr[r] = j
        clock[r] = t_rank
    if any(ptr[r] < cuts[r + 1] for r in range(len(clock))):
        return None
    ends.pop()
    return ends, clock, link_free


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
    steps, clock0 = times.steps, times.clock0
    offsets = steps.offsets
    n = offsets[-1]
    e_ev = np.array(times.ends)
    count = len(steps.comp)
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
