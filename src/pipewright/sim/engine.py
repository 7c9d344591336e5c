"""The discrete-event simulator: a Schedule + a CostModel (+ a CommModel) → a predicted Timeline.

Execution rules (see ``docs/simulator.md``):

- Each rank runs its lowered actions in program order. A **compute** kind (``KindSpec.compute``: F, B,
  I, W, STEP, extension compute kinds) occupies the rank's compute stream for ``cost.compute_time``.
- A **send** (``comm == "send"``) does not block: when the rank reaches it (and its requirements are
  met) it launches a transfer of ``cost.message_bytes`` bytes that lasts
  ``comm.p2p_time(src, dst, bytes)``; the send's event completes when the data arrives.
- A **receive** (``comm == "recv"``) takes no time; the rank waits there until its matching send's
  data has arrived. So communication overlaps compute, and only the dependent receive waits.
- **Link sharing**: each directed rank pair ``(src, dst)`` is one FIFO link; transfers on it run one
  after another in the sender's program order (a transfer starts at max(issue time, link free)).
  Transfers on different pairs never slow each other.
- A **collective** (``KindSpec.collective``, e.g. REDUCE_GRAD over dp) runs on the rank's separate
  collective stream for ``comm.collective_time(op, rank, bytes, group, members)``, overlapping later
  compute; actions that require its event (STEP) wait for it. A collective whose group spans pipeline
  ranks (``group="pp"`` or explicit members) is a **rendezvous**: each member issues it without
  blocking, and it starts when the last member has issued it and each member's stream for that group
  is free (one FIFO stream per rank and group, as one communicator per process group); all members'
  actions end together. dp and tp collectives involve only copies of the simulated rank.
- Any other kind without compute or comm flags is a zero-time marker.
- Every requirement comes from :func:`pipewright.deps.requires` / :func:`~pipewright.deps.produces`;
  the simulator resolves each requirement once to the index of the action that produces it and never
  re-derives a rule.

Iterations: rank r starts iteration k+1 after its own iteration-k actions (program order), so each
stage's next forward follows its previous optimizer step. With ``step_barrier=True`` every rank also
waits for the end of iteration k on all ranks (the global optimizer-step synchronization, e.g.
global gradient-norm clipping). Because every resource (compute stream, collective stream, link) serves
its work in a fixed order, times are a max-plus function of the schedule and can be evaluated in any
order that respects dependencies: ranks are advanced from a ready stack and a blocked rank is woken
by the event it waits on — no event heap and no rescans are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.deps import Resolution, resolve
from pipewright.errors import PipewrightError
from pipewright.ir import Action, Schedule
from pipewright.passes.lower import lower
from pipewright.passes.validate import validate, validate_resolved
from pipewright.sim.flat import compile_flat
from pipewright.sim.memory import peak_from_deltas
from pipewright.sim.program import (
    _COLLECTIVE,
    _COMPUTE,
    _NOT_DONE,
    _RENDEZVOUS,
    _SEND,
    _WAIT,
    _mode,
    _Program,
    first_missing,
    flat_requirements,
    gc_paused,
)
from pipewright.sim.steps import StepTimes, run_steps

if TYPE_CHECKING:  # imported where used: timelines and shared cores are not every run's
    from pipewright.sim.sharing import SharedCompute
    from pipewright.timeline import Timeline


class SimulationError(PipewrightError):
    """The schedule cannot be simulated (it deadlocks or an option is invalid)."""


def _compile(schedule: Schedule, cost: CostModel, comm: CommModel, res: Resolution | None = None) -> _Program:
    """Resolve every requirement to its producing action and cost every action, once.

    Costs are asked once per (kind, stage, payload): every microbatch of a stage costs the same. A
    send's duration needs its destination — the rank of the action that requires its event — so sends
    are costed after the requirements are resolved.
    """
    res = res or resolve(schedule)
    mode_of = {name: _mode(schedule.kinds[name]) for name in schedule.kinds}
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
    compute_cost: dict[tuple, tuple[float, float, float, float]] = {}
    flops = model_flops = 0.0
    meetings: dict[tuple, list[int]] = {}
    meet_prev: dict[int, int] = {}
    meet_stream: dict[int, tuple[int, str]] = {}
    last_meet: dict[tuple[int, str], int] = {}
    g = 0
    for rank, row in enumerate(rows):
        deltas = []
        total = 0.0
        for a in row:
            mode = mode_of[a[1]]
            modes.append(mode)
            if mode == _COMPUTE:
                key = (a.kind, a.stage, a.payload)
                c = compute_cost.get(key)
                if c is None:
                    c = compute_cost[key] = (
                        float(cost.compute_time(a, schedule)),
                        float(cost.flops(a, schedule)),
                        float(cost.model_flops(a, schedule)),
                        float(cost.activation_bytes(a, schedule)),
                    )
                total += c[0]
                flops += c[1]
                model_flops += c[2]
                deltas.append(c[3])
                durs.append(c[0])
            elif mode in (_COLLECTIVE, _RENDEZVOUS):
                coll = schedule.kinds[a.kind].collective
                members = coll.participants(a, schedule)
                nbytes = cost.message_bytes(a, schedule)
                durs.append(float(comm.collective_time(coll.op, rank, nbytes, coll.group, members)))
                if mode == _RENDEZVOUS:
                    meetings.setdefault((a.kind, a.microbatch, a.payload, members), []).append(g)
                    stream = (rank, coll.group)
                    meet_prev[g] = last_meet.get(stream, -1)
                    meet_stream[g] = stream
                    last_meet[stream] = g
            else:
                if mode == _SEND:
                    sends.append(g)
                durs.append(0.0)
            g += 1
        busy.append(total)
        peaks.append(peak_from_deltas(deltas, float(cost.static_bytes(rank, schedule))))

    destination: dict[int, int] = {}  # send g -> the rank that needs its event
    reqs: list[tuple[int, ...]] = []
    local = (_COMPUTE, _WAIT)
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
    return _Program(
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


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts. Times are in the cost model's unit (seconds for real models).

    ``iteration_time``: steady-state period (end of last iteration − end of first) / (iterations − 1),
    or the makespan for one iteration. ``busy[r]``: compute time of rank r in one iteration;
    ``bubble[r] = iteration_time − busy[r]``. ``peak_memory[r]``: static bytes + the highest running
    sum of activation bytes over the rank's compute actions. ``flops`` / ``model_flops``: per iteration
    (with / without recomputation). ``iteration_ends[k]``: when iteration k's last action finished.
    ``source``: the schedule as given (or as lowered by the per-action path); :attr:`schedule`, the
    lowered one, and the :attr:`timeline` (all iterations) are built on first access.
    """

    source: Schedule
    iterations: int
    step_barrier: bool
    iteration_time: float
    iteration_ends: tuple[float, ...]
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_memory: tuple[float, ...]
    flops: float
    model_flops: float
    _starts: list = field(repr=False, compare=False)  # per iteration, by global index (or StepTimes)
    _ends: list = field(repr=False, compare=False)  # read through _times
    _program: _Program = field(repr=False, compare=False)

    @cached_property
    def schedule(self) -> Schedule:
        """The lowered schedule that was simulated (built on first access when the array path,
        :mod:`pipewright.sim.flat`, simulated it without one)."""
        return lower(self.source)

    @property
    def num_ranks(self) -> int:
        return self.source.num_ranks

    @property
    def makespan(self) -> float:
        """End of the last iteration (the run starts at 0)."""
        return self.iteration_ends[-1]

    @property
    def num_actions(self) -> int:
        """Actions simulated: lowered actions per iteration × iterations."""
        return self._program.missing * self.iterations

    @property
    def bubble_fraction(self) -> float:
        """Σ_r bubble_r / (ranks × iteration_time): idle over total, as :meth:`Timeline.bubble_fraction`."""
        if self.iteration_time <= 0:
            return 0.0
        return sum(self.bubble) / (self.num_ranks * self.iteration_time)

    @cached_property
    def timeline(self) -> Timeline:
        """Compute spans (stream "compute") and non-zero transfers/collectives (stream "comm")."""
        from pipewright.timeline import Span, Timeline

        sched, prog = self.schedule, self._program.listed
        spans: list[Span] = []
        for rank, row in enumerate(sched.actions):
            first = prog.offsets[rank]
            for it in range(self.iterations):
                starts, ends = self._times(it)
                for g, a in enumerate(row, first):
                    mode = prog.modes[g]
                    if mode == _COMPUTE:
                        spans.append(Span(rank, a, starts[g], ends[g], "compute", it))
                    elif mode in (_SEND, _COLLECTIVE, _RENDEZVOUS) and prog.durs[g] > 0:
                        spans.append(Span(rank, a, starts[g], ends[g], "comm", it))
        meta = {
            "schedule": sched.name,
            "iterations": self.iterations,
            "iteration_time": self.iteration_time,
            "step_barrier": self.step_barrier,
        }
        return Timeline.of(sched.num_ranks, spans, source="simulated", meta=meta)

    def _times(self, iteration: int) -> tuple[list[float], list[float]]:
        """Starts and ends of ``iteration`` by global index, as lists (the compute-only loop's event
        times are expanded here, once)."""
        times = self._starts[iteration]
        if isinstance(times, StepTimes):
            self._starts[iteration], self._ends[iteration] = times.expand()
        return self._starts[iteration], self._ends[iteration]

    def spans_of(self, rank: int, iteration: int = 0) -> list[tuple[Action, float, float]]:
        """(action, start, end) of every action of ``rank`` in ``iteration`` (sends: the transfer)."""
        first = self._program.offsets[rank]
        s, e = self._times(iteration)
        return [(a, s[g], e[g]) for g, a in enumerate(self.schedule.actions[rank], first)]


def simulate(
    schedule: Schedule,
    cost: CostModel,
    *,
    comm: CommModel | None = None,
    iterations: int = 1,
    step_barrier: bool = True,
    shared: SharedCompute | None = None,
    validate: bool = False,
) -> SimResult:
    """Simulate ``iterations`` training iterations of ``schedule`` (lowered first if needed).

    ``shared``: ranks that share compute units (:mod:`pipewright.sim.sharing`, processor sharing);
    then a compute action lasts longer than its cost while its host is oversubscribed, and
    ``busy[r]`` is the time rank r spent computing in the last iteration (not the sum of costs).
    With ``validate=True`` the lowered schedule is validated first; otherwise it is not validated
    here, and a schedule that cannot finish is reported with the validator's message.

    Two paths give the same results: the array path (:mod:`pipewright.sim.flat`: lowering, resolution,
    the validator's checks and the compile over integer arrays, no per-action objects) is tried first;
    when it declines, the per-action path lowers, resolves (:func:`pipewright.deps.resolve`, shared by
    the validator and the compile) and names whatever is wrong.
    """
    if iterations < 1:
        raise SimulationError(f"--iterations must be at least 1 (got {iterations})")
    with gc_paused():
        return _simulate(schedule, cost, comm, iterations, step_barrier, shared, validate)


def _simulate(
    schedule: Schedule,
    cost: CostModel,
    comm: CommModel | None,
    iterations: int,
    step_barrier: bool,
    shared: SharedCompute | None,
    validate: bool,
) -> SimResult:
    comm = comm or FreeComm()
    flat = compile_flat(schedule, cost, comm, check=validate)
    if flat is not None:  # the array path: no per-action objects, the lowered schedule on demand
        prog, sched = flat[0], flat[1] or schedule
    else:  # the per-action path; its validator names what is wrong
        sched = lower(schedule)
        res = validate_resolved(sched) if validate else None
        prog = _compile(sched, cost, comm, res)
    num_ranks = sched.num_ranks
    clock = [0.0] * num_ranks
    coll_free = [0.0] * num_ranks
    link_free = [0.0] * prog.num_links
    meet_free: dict[tuple[int, str], float] = {}
    all_starts: list[list[float] | StepTimes] = []  # per iteration, as SimResult._starts
    all_ends: list[list[float] | StepTimes] = []
    iteration_ends: list[float] = []
    steps = prog.steps if shared is None else None
    for _ in range(iterations):
        done = run_steps(steps, clock, link_free) if steps is not None else None
        if done is not None:  # the compute-only loop (pipewright.sim.steps): times expanded on demand
            starts = ends = StepTimes(steps, done[0], list(clock), list(link_free))
            clock[:], link_free[:] = done[1], done[2]
        elif shared is None:
            starts, ends = _run_iteration(sched, prog.listed, clock, coll_free, link_free, meet_free)
        else:
            if prog.meets:
                raise SimulationError(
                    f"{sched.name}: collectives across pipeline ranks are not simulated with shared "
                    "cores yet; drop --cores"
                )
            from pipewright.sim.sharing import run_iteration_shared

            starts, ends, positions = run_iteration_shared(prog.listed, clock, coll_free, link_free, shared)
            if any(p < prog.offsets[r + 1] - prog.offsets[r] for r, p in enumerate(positions)):
                _report_deadlock(sched, list(positions))
        all_starts.append(starts)
        all_ends.append(ends)
        # compute-only loop: a compute action ends by its rank's clock, a send by its link's free time
        latest = link_free if isinstance(ends, StepTimes) else ends
        end = max(max(latest, default=0.0), max(clock, default=0.0))
        iteration_ends.append(end)
        if step_barrier:
            clock = [end] * num_ranks
    if iterations > 1:
        period = (iteration_ends[-1] - iteration_ends[0]) / (iterations - 1)
    else:
        period = iteration_ends[0]
    busy = prog.busy if shared is None else _computing_time(prog.listed, all_starts[-1], all_ends[-1])
    return SimResult(
        source=sched,
        iterations=iterations,
        step_barrier=step_barrier,
        iteration_time=period,
        iteration_ends=tuple(iteration_ends),
        busy=tuple(busy),
        bubble=tuple(period - b for b in busy),
        peak_memory=tuple(prog.peak_memory),
        flops=prog.flops,
        model_flops=prog.model_flops,
        _starts=all_starts,
        _ends=all_ends,
        _program=prog,
    )


def _run_iteration(
    sched: Schedule,
    prog: _Program,
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
    ends = [_NOT_DONE] * (n_total + 1)  # ends[g] is also the time of g's events; the last never comes
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
            if mode == _COMPUTE:
                end = t_rank = t + durs[g]
            elif mode == _SEND:
                link = links[g]
                if link_free[link] > t:
                    t = link_free[link]
                end = link_free[link] = t + durs[g]
            elif mode == _WAIT:
                end = t_rank = t
            elif mode == _COLLECTIVE:
                if coll_free[r] > t:
                    t = coll_free[r]
                end = coll_free[r] = t + durs[g]
            else:  # _RENDEZVOUS
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
        _report_deadlock(sched, [ptr[r] - offsets[r] for r in range(len(clock))])
    ends.pop()
    return starts, ends


def _computing_time(prog: _Program, starts: list[float], ends: list[float]) -> list[float]:
    """Per rank, the wall time its compute actions occupied (their spans, stretched by sharing)."""
    out = []
    for r in range(len(prog.offsets) - 1):
        span = range(prog.offsets[r], prog.offsets[r + 1])
        out.append(sum(ends[g] - starts[g] for g in span if prog.modes[g] == _COMPUTE))
    return out


def _report_deadlock(sched: Schedule, positions: list[int]) -> None:
    sched = lower(sched)
    validate(sched)  # raises a ValidationError naming rank, position and action
    heads = ", ".join(
        f"rank {r} at {sched.actions[r][p]}" for r, p in enumerate(positions) if p < len(sched.actions[r])
    )
    raise SimulationError(f"{sched.name}: simulation stuck ({heads})")
