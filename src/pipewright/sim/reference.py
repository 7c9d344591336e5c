"""The simulator's reference path: a lowered schedule compiled action by action from the dependency
resolution (:func:`pipewright.deps.resolve`, the validator's) and run one lowered action at a time, with
every mode (compute, send, receive, collective, rendezvous). :func:`pipewright.sim.engine.simulate` takes
it when the fast path declines (its compile is the one that names what is wrong), and runs its loop
(:func:`run_iteration`) for the rare fast-compiled program the compute-only loop
(:mod:`pipewright.sim.fast_loop`) does not take. ``tests/test_sim_fast_path.py`` holds the fast path to it, to
the bit. The execution rules are :mod:`pipewright.sim.engine`'s.
"""

from __future__ import annotations

from pipewright.cost.base import CommModel, CostModel
from pipewright.deps import Resolution, resolve
from pipewright.ir import Schedule
from pipewright.passes.lower import lower
from pipewright.passes.validate import validate
from pipewright.sim.array_coding import varies_per_action
from pipewright.sim.compiled import (
    COLLECTIVE,
    COMPUTE,
    NOT_DONE,
    RENDEZVOUS,
    SEND,
    WAIT,
    Program,
    SimulationError,
    action_mode,
    first_missing,
    flat_requirements,
)
from pipewright.sim.memory import peak_from_deltas, transient_of


def compile_actions(
    schedule: Schedule, cost: CostModel, comm: CommModel, res: Resolution | None = None
) -> Program:
    """Resolve every requirement to its producing action and cost every action, once.

    Costs are asked once per (kind, stage, payload): every microbatch of a stage costs the same — except
    for a cost model that :func:`~pipewright.sim.array_coding.varies_per_action`, asked once per action. A
    send's duration needs its destination — the rank of the action that requires its event — so sends
    are costed after the requirements are resolved.
    """
    res = res or resolve(schedule)
    offsets = [0]
    for row in schedule.actions:
        offsets.append(offsets[-1] + len(row))
    costed = _Costed(schedule, cost, comm)
    for rank, row in enumerate(schedule.actions):
        costed.add_rank(rank, row, offsets[rank])
    reqs, destination = _requirements(res.needs, costed.modes, offsets)
    links, num_links = _links(schedule, cost, comm, costed, offsets, destination)
    meets = {g: tuple(group) for group in costed.meetings.values() for g in group}
    return Program(
        offsets, *flat_requirements(reqs), costed.modes, costed.durs, links, num_links, costed.busy,
        costed.flops, costed.model_flops, costed.peaks, meets, costed.meet_prev, costed.meet_stream,
    )  # fmt: skip


class _Costed:
    """The modes and durations of the actions (sends: 0 until :func:`_links` costs them), per rank the
    busy time and the memory peak, the FLOPs, and the rendezvous: their members by (kind, microbatch,
    payload, members), and per member the previous one on its (rank, group) stream."""

    def __init__(self, schedule: Schedule, cost: CostModel, comm: CommModel) -> None:
        self.schedule, self.cost, self.comm = schedule, cost, comm
        self.mode_of = {name: action_mode(schedule.kinds[name]) for name in schedule.kinds}
        self.transient = transient_of(cost)
        self.each = varies_per_action(cost)  # then the microbatch is part of the key
        self.compute_cost: dict[tuple, tuple[float, float, float, float, float]] = {}
        self.modes: list[int] = []
        self.durs: list[float] = []
        self.busy: list[float] = []
        self.peaks: list[float] = []
        self.sends: list[int] = []
        self.flops = self.model_flops = 0.0
        self.meetings: dict[tuple, list[int]] = {}
        self.meet_prev: dict[int, int] = {}
        self.meet_stream: dict[int, tuple[int, str]] = {}
        self.last_meet: dict[tuple[int, str], int] = {}

    def _compute(self, a) -> tuple[float, float, float, float, float]:
        """(time, FLOPs, model FLOPs, activation bytes, transient bytes) of a compute action."""
        key = (a.kind, a.stage, a.payload, a.microbatch) if self.each else (a.kind, a.stage, a.payload)
        c = self.compute_cost.get(key)
        if c is None:
            sched, cost = self.schedule, self.cost
            c = self.compute_cost[key] = (
                float(cost.compute_time(a, sched)),
                float(cost.flops(a, sched)),
                float(cost.model_flops(a, sched)),
                float(cost.activation_bytes(a, sched)),
                float(self.transient(a, sched)),
            )
        return c

    def _collective(self, a, rank: int, g: int, mode: int) -> float:
        """A collective's duration; a rendezvous joins its meeting and its stream's order."""
        coll = self.schedule.kinds[a.kind].collective
        members = coll.participants(a, self.schedule)
        nbytes = self.cost.message_bytes(a, self.schedule)
        if mode == RENDEZVOUS:
            self.meetings.setdefault((a.kind, a.microbatch, a.payload, members), []).append(g)
            stream = (rank, coll.group)
            self.meet_prev[g] = self.last_meet.get(stream, -1)
            self.meet_stream[g] = stream
            self.last_meet[stream] = g
        return float(self.comm.collective_time(coll.op, rank, nbytes, coll.group, members))

    def add_rank(self, rank: int, row, g: int) -> None:
        """The actions of ``rank`` (``row``), the first with global index ``g``."""
        deltas, extras = [], []
        total = 0.0
        for a in row:
            mode = self.mode_of[a[1]]
            self.modes.append(mode)
            if mode == COMPUTE:
                c = self._compute(a)
                total += c[0]
                self.flops += c[1]
                self.model_flops += c[2]
                deltas.append(c[3])
                extras.append(c[4])
                self.durs.append(c[0])
            elif mode in (COLLECTIVE, RENDEZVOUS):
                self.durs.append(self._collective(a, rank, g, mode))
            else:
                if mode == SEND:
                    self.sends.append(g)
                self.durs.append(0.0)
            g += 1
        self.busy.append(total)
        static = float(self.cost.static_bytes(rank, self.schedule))
        self.peaks.append(peak_from_deltas(deltas, static, extras if any(extras) else None))


def _requirements(needs, modes: list[int], offsets: list[int]):
    """Per action, the producers it waits for — without earlier compute/wait actions of its own rank,
    which ended before its clock —, and per send the rank that needs its event (its destination)."""
    destination: dict[int, int] = {}
    reqs: list[tuple[int, ...]] = []
    local = (COMPUTE, WAIT)
    total_actions = offsets[-1]
    for rank in range(len(offsets) - 1):
        first, last = offsets[rank], offsets[rank + 1]
        for g in range(first, last):
            needed = ()
            for src in needs[g]:
                if first <= src < g:
                    if modes[src] in local:
                        continue  # an earlier compute/wait action of this rank ended before the clock
                elif src < total_actions and not first <= src < last:
                    destination[src] = rank  # produced on another rank: a send's destination
                needed += (src,)
            reqs.append(needed)
    return reqs, destination


def _links(schedule: Schedule, cost: CostModel, comm: CommModel, costed: _Costed, offsets, destination):
    """Each send's link — one FIFO link per (source, destination) rank pair, numbered in order of first
    use — and its transfer time (into ``costed.durs``); the number of links."""
    rows = schedule.actions
    link_id: dict[tuple[int, int], int] = {}
    links = [-1] * offsets[-1]
    rank_of = [r for r, row in enumerate(rows) for _ in row] if costed.sends else []
    for g in costed.sends:
        src = rank_of[g]
        dst = destination.get(g, src)
        if dst != src:
            a = rows[src][g - offsets[src]]
            costed.durs[g] = float(comm.p2p_time(src, dst, cost.message_bytes(a, schedule)))
        links[g] = link_id.setdefault((src, dst), len(link_id))
    return links, len(link_id)


def run_iteration(
    sched: Schedule,
    prog: Program,
    clock: list[float],
    coll_free: list[float],
    link_free: list[float],
    meet_free: dict[tuple[int, str], float],
) -> tuple[list[float], list[float]]:
    """Advance every rank through one iteration from ``clock``; updates clocks and stream/link state.

    Returns the start and end time of every action by global index (a send: its transfer).
    """
    n_total = prog.missing
    starts = [0.0] * n_total
    ends = [NOT_DONE] * (n_total + 1)  # ends[g] is also the time of g's events; the last never comes
    req1, extra = prog.req1, prog.extra
    modes, durs, links, offsets = prog.modes, prog.durs, prog.links, prog.offsets
    waiting: dict[int, list[int]] = {}
    awaited = bytearray(n_total + 1)  # awaited[g]: some rank waits in ``waiting`` for g's end
    ptr = offsets[:-1]
    ready = list(range(len(clock) - 1, -1, -1))
    meetings = _Meetings(prog, starts, ends, waiting, ready, meet_free)

    while ready:
        r = ready.pop()
        first, stop, t_rank = ptr[r], offsets[r + 1], clock[r]
        for g in range(first, stop):  # a for over a range: fewer steps per action than a while
            t = t_rank
            e = req1[g]
            if e >= 0:  # one producer (almost every action)
                te = ends[e]
                if te < 0.0:
                    waiting.setdefault(e, []).append(r)
                    awaited[e] = 1
                    break
                if te > t:
                    t = te
            elif e == -2:  # several
                e, t = first_missing(extra[g], ends, t)
                if e >= 0:
                    waiting.setdefault(e, []).append(r)
                    awaited[e] = 1
                    break
            mode = modes[g]  # by frequency: compute, send, receive/marker, collective, rendezvous
            if mode == COMPUTE:
                end = t_rank = t + durs[g]
            elif mode == SEND:
                link = links[g]
                if link_free[link] > t:
                    t = link_free[link]
                end = link_free[link] = t + durs[g]
            elif mode == WAIT:
                end = t_rank = t
            elif mode == COLLECTIVE:
                if coll_free[r] > t:
                    t = coll_free[r]
                end = coll_free[r] = t + durs[g]
            else:  # RENDEZVOUS
                meetings.issue(g, t)  # non-blocking; its end comes with the last member
                continue
            starts[g] = t
            ends[g] = end
            if awaited[g]:
                ready.extend(waiting.pop(g))
        else:  # the rank ran to the end of its row (or had nothing left)
            g = stop
        ptr[r] = g
        clock[r] = t_rank
    if any(ptr[r] < offsets[r + 1] for r in range(len(clock))):
        report_deadlock(sched, [ptr[r] - offsets[r] for r in range(len(clock))])
    ends.pop()
    return starts, ends


class _Meetings:
    """The rendezvous of one iteration: each is resolved once every member issued it and each member's
    stream (one per rank and group) is free; then its members' ranks waiting for it may go on."""

    def __init__(self, prog: Program, starts, ends, waiting, ready, meet_free) -> None:
        self.prog, self.starts, self.ends, self.waiting, self.ready = prog, starts, ends, waiting, ready
        self.meet_free = meet_free
        self.issued: dict[int, float] = {}  # rendezvous member g -> when its rank issued it
        self.next_meet = {prev: g for g, prev in prog.meet_prev.items() if prev >= 0}

    def issue(self, g: int, t: float) -> None:
        """Member ``g`` issued at ``t``."""
        self.issued[g] = t
        self.resolve(g)

    def resolve(self, g: int) -> None:
        """Resolve g's rendezvous if it can be, then the next ones on its members' streams."""
        prog, ends, issued = self.prog, self.ends, self.issued
        group = prog.meets[g]
        t = 0.0
        for h in group:
            if h not in issued:
                return
            prev = prog.meet_prev[h]
            if prev >= 0:
                if ends[prev] < 0.0:
                    return  # resolved when the previous one on that stream is
                free = ends[prev]
            else:
                free = self.meet_free.get(prog.meet_stream[h], 0.0)
            t = max(t, issued[h], free)
        end = t + max(prog.durs[h] for h in group)
        for h in group:
            self.starts[h], ends[h] = t, end
            self.meet_free[prog.meet_stream[h]] = end
            woken = self.waiting.pop(h, None)
            if woken:
                self.ready.extend(woken)
        for h in group:
            nxt = self.next_meet.get(h)
            if nxt is not None and nxt in issued:
                self.resolve(nxt)


def computing_time(prog: Program, starts: list[float], ends: list[float]) -> list[float]:
    """Per rank, the wall time its compute actions occupied (their spans, stretched by sharing)."""
    out = []
    for r in range(len(prog.offsets) - 1):
        span = range(prog.offsets[r], prog.offsets[r + 1])
        out.append(sum(ends[g] - starts[g] for g in span if prog.modes[g] == COMPUTE))
    return out


def report_deadlock(sched: Schedule, positions: list[int]) -> None:
    sched = lower(sched)
    validate(sched)  # raises a ValidationError naming rank, position and action
    heads = ", ".join(
        f"rank {r} at {sched.actions[r][p]}" for r, p in enumerate(positions) if p < len(sched.actions[r])
    )
    raise SimulationError(f"{sched.name}: simulation stuck ({heads})")
