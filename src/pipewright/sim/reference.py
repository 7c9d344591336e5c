"""The simulator's per-action path: a lowered schedule compiled action by action from the dependency
resolution (:func:`pipewright.deps.resolve`, shared with the validator) and run one lowered action at a
time, with every mode (compute, send, receive, collective, rendezvous). :func:`pipewright.sim.engine.simulate`
takes it when the array path (:mod:`pipewright.sim.lowered_compile`) declines, and for shared cores and schedules
the compute-only loop (:mod:`pipewright.sim.fast_loop`) does not run. The execution rules are
:mod:`pipewright.sim.engine`'s.
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
    mode_of = {name: action_mode(schedule.kinds[name]) for name in schedule.kinds}
    rows = schedule.actions
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    total_actions = offsets[-1]
    modes: list[int] = []
    durs: list[float] = []
    busy: list[float] = []
    peaks: list[float] = []
    sends: list[int] = []
    compute_cost: dict[tuple, tuple[float, float, float, float, float]] = {}
    transient = transient_of(cost)
    each = varies_per_action(cost)  # then the microbatch is part of the key
    flops = model_flops = 0.0
    meetings: dict[tuple, list[int]] = {}
    meet_prev: dict[int, int] = {}
    meet_stream: dict[int, tuple[int, str]] = {}
    last_meet: dict[tuple[int, str], int] = {}
    g = 0
    for rank, row in enumerate(rows):
        deltas, extras = [], []
        total = 0.0
        for a in row:
            mode = mode_of[a[1]]
            modes.append(mode)
            if mode == COMPUTE:
                key = (a.kind, a.stage, a.payload, a.microbatch) if each else (a.kind, a.stage, a.payload)
                c = compute_cost.get(key)
                if c is None:
                    c = compute_cost[key] = (
                        float(cost.compute_time(a, schedule)),
                        float(cost.flops(a, schedule)),
                        float(cost.model_flops(a, schedule)),
                        float(cost.activation_bytes(a, schedule)),
                        float(transient(a, schedule)),
                    )
                total += c[0]
                flops += c[1]
                model_flops += c[2]
                deltas.append(c[3])
                extras.append(c[4])
                durs.append(c[0])
            elif mode in (COLLECTIVE, RENDEZVOUS):
                coll = schedule.kinds[a.kind].collective
                members = coll.participants(a, schedule)
                nbytes = cost.message_bytes(a, schedule)
                durs.append(float(comm.collective_time(coll.op, rank, nbytes, coll.group, members)))
                if mode == RENDEZVOUS:
                    meetings.setdefault((a.kind, a.microbatch, a.payload, members), []).append(g)
                    stream = (rank, coll.group)
                    meet_prev[g] = last_meet.get(stream, -1)
                    meet_stream[g] = stream
                    last_meet[stream] = g
            else:
                if mode == SEND:
                    sends.append(g)
                durs.append(0.0)
            g += 1
        busy.append(total)
        static = float(cost.static_bytes(rank, schedule))
        peaks.append(peak_from_deltas(deltas, static, extras if any(extras) else None))

    destination: dict[int, int] = {}  # send g -> the rank that needs its event
    reqs: list[tuple[int, ...]] = []
    local = (COMPUTE, WAIT)
    needs = res.needs
    for rank in range(len(rows)):
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

    link_id: dict[tuple[int, int], int] = {}
    links = [-1] * total_actions
    rank_of = [r for r, row in enumerate(rows) for _ in row] if sends else []
    for g in sends:
        src = rank_of[g]
        dst = destination.get(g, src)
        if dst != src:
            a = rows[src][g - offsets[src]]
            durs[g] = float(comm.p2p_time(src, dst, cost.message_bytes(a, schedule)))
        links[g] = link_id.setdefault((src, dst), len(link_id))
    meets = {g: tuple(group) for group in meetings.values() for g in group}
    return Program(
        offsets,
        *flat_requirements(reqs),
        modes,
        durs,
        links,
        len(link_id),
        busy,
        flops,
        model_flops,
        peaks,
        meets,
        meet_prev,
        meet_stream,
    )


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
    issued: dict[int, float] = {}  # rendezvous member g -> when its rank issued it
    next_meet = {prev: g for g, prev in prog.meet_prev.items() if prev >= 0}

    def meet(g: int) -> None:
        """Resolve g's rendezvous once every member issued it and each member's stream is free."""
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
                free = meet_free.get(prog.meet_stream[h], 0.0)
            t = max(t, issued[h], free)
        end = t + max(durs[h] for h in group)
        for h in group:
            starts[h], ends[h] = t, end
            meet_free[prog.meet_stream[h]] = end
            woken = waiting.pop(h, None)
            if woken:
                ready.extend(woken)
        for h in group:
            nxt = next_meet.get(h)
            if nxt is not None and nxt in issued:
                meet(nxt)

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
                issued[g] = t  # non-blocking issue; its end comes with the last member
                meet(g)
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
