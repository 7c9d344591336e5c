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
- A **collective** (``comm == "collective"``, e.g. REDUCE_GRAD) runs on the rank's separate
  collective stream for ``comm.collective_time("all_reduce", rank, bytes)``, overlapping later compute;
  actions that require its event (STEP) wait for it.
- Any other kind without compute or comm flags is a zero-time marker.
- Every requirement comes from :func:`pipewright.deps.requires` / :func:`~pipewright.deps.produces`;
  the simulator turns them into integer event indices once and never re-derives a rule.

Iterations: rank r starts iteration k+1 after its own iteration-k actions (program order), so each
stage's next forward follows its previous optimizer step. With ``step_barrier=True`` every rank also
waits for the end of iteration k on all ranks (the global optimizer-step synchronization, e.g.
global gradient-norm clipping). Because every resource (compute stream, collective stream, link) serves
its work in a fixed order, times are a max-plus function of the schedule and can be evaluated in any
order that respects dependencies: ranks are advanced from a ready stack and a blocked rank is woken
by the event it waits on — no event heap and no rescans are needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.deps import produces, requires
from pipewright.errors import PipewrightError
from pipewright.ir import Action, Schedule
from pipewright.passes.lower import lower
from pipewright.sim.memory import peak_from_deltas
from pipewright.timeline import Span, Timeline

# Action modes in the precomputed program.
_COMPUTE, _SEND, _COLLECTIVE, _WAIT = 0, 1, 2, 3
_NOT_DONE = -1.0


class SimulationError(PipewrightError):
    """The schedule cannot be simulated (it deadlocks or an option is invalid)."""


@dataclass(frozen=True)
class _Program:
    """A lowered schedule compiled to flat per-rank arrays of integers and floats."""

    num_events: int
    reqs: list[list[tuple[int, ...]]]  # per rank, per position: event indices to wait for
    outs: list[list[tuple[int, ...]]]  # per rank, per position: event indices produced
    modes: list[list[int]]
    durs: list[list[float]]
    links: list[list[int]]  # link index for sends, -1 otherwise
    num_links: int
    busy: list[float]  # compute time of one iteration per rank
    flops: float
    model_flops: float
    peak_memory: list[float]


def _compile(schedule: Schedule, cost: CostModel, comm: CommModel) -> _Program:
    """Index every event as an int and every action's cost once (the simulator's only setup)."""
    specs = {name: schedule.kinds[name] for name in schedule.kinds}
    event_id: dict[tuple, int] = {}
    intern = event_id.setdefault
    produced_by: dict[int, tuple[int, int, int]] = {}  # event -> (rank, position, mode)
    rows = schedule.actions
    outs: list[list[tuple[int, ...]]] = []
    modes: list[list[int]] = []
    for rank, row in enumerate(rows):
        r_outs, r_modes = [], []
        for pos, a in enumerate(row):
            spec = specs[a.kind]
            mode = (
                _COMPUTE
                if spec.compute
                else _SEND
                if spec.comm == "send"
                else _COLLECTIVE
                if spec.comm == "collective"
                else _WAIT
            )
            evs = tuple(intern(ev, len(event_id)) for ev in produces(a, schedule))
            for e in evs:
                produced_by[e] = (rank, pos, mode)
            r_outs.append(evs)
            r_modes.append(mode)
        outs.append(r_outs)
        modes.append(r_modes)

    consumers: dict[int, int] = {}  # event -> a rank that needs it from elsewhere (a send's destination)
    reqs: list[list[tuple[int, ...]]] = []
    for rank, row in enumerate(rows):
        r_reqs = []
        for pos, a in enumerate(row):
            needed = []
            for ev in requires(a, schedule):
                e = intern(ev, len(event_id))
                src = produced_by.get(e)
                if src is not None and src[0] != rank:
                    consumers[e] = rank
                # An earlier compute/wait action of this rank ended before the clock: always satisfied.
                if src is not None and src[0] == rank and src[1] < pos and src[2] in (_COMPUTE, _WAIT):
                    continue
                needed.append(e)
            r_reqs.append(tuple(needed))
        reqs.append(r_reqs)

    link_id: dict[tuple[int, int], int] = {}
    durs: list[list[float]] = []
    links: list[list[int]] = []
    busy: list[float] = []
    deltas: list[list[float]] = []
    flops = model_flops = 0.0
    for rank, row in enumerate(rows):
        r_durs, r_links, r_deltas = [], [], []
        total = 0.0
        for pos, a in enumerate(row):
            mode = modes[rank][pos]
            link = -1
            if mode == _COMPUTE:
                d = float(cost.compute_time(a, schedule))
                total += d
                flops += cost.flops(a, schedule)
                model_flops += cost.model_flops(a, schedule)
                r_deltas.append(float(cost.activation_bytes(a, schedule)))
            elif mode == _SEND:
                dst = _destination(outs[rank][pos], consumers, rank)
                nbytes = cost.message_bytes(a, schedule)
                d = float(comm.p2p_time(rank, dst, nbytes)) if dst != rank else 0.0
                link = link_id.setdefault((rank, dst), len(link_id))
            elif mode == _COLLECTIVE:
                d = float(comm.collective_time("all_reduce", rank, cost.message_bytes(a, schedule)))
            else:
                d = 0.0
            r_durs.append(d)
            r_links.append(link)
        durs.append(r_durs)
        links.append(r_links)
        busy.append(total)
        deltas.append(r_deltas)
    peaks = [peak_from_deltas(deltas[r], float(cost.static_bytes(r, schedule))) for r in range(len(rows))]
    return _Program(
        len(event_id), reqs, outs, modes, durs, links, len(link_id), busy, flops, model_flops, peaks
    )


def _destination(events: tuple[int, ...], consumers: dict[int, int], rank: int) -> int:
    for e in events:
        dst = consumers.get(e)
        if dst is not None and dst != rank:
            return dst
    return rank


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts. Times are in the cost model's unit (seconds for real models).

    ``iteration_time``: steady-state period (end of last iteration − end of first) / (iterations − 1),
    or the makespan for one iteration. ``busy[r]``: compute time of rank r in one iteration;
    ``bubble[r] = iteration_time − busy[r]``. ``peak_memory[r]``: static bytes + the highest running
    sum of activation bytes over the rank's compute actions. ``flops`` / ``model_flops``: per iteration
    (with / without recomputation). ``iteration_ends[k]``: when iteration k's last action finished.
    The :attr:`timeline` (all iterations) is built on first access.
    """

    schedule: Schedule
    iterations: int
    step_barrier: bool
    iteration_time: float
    iteration_ends: tuple[float, ...]
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_memory: tuple[float, ...]
    flops: float
    model_flops: float
    _starts: list[list[float]] = field(repr=False, compare=False)
    _ends: list[list[float]] = field(repr=False, compare=False)
    _program: _Program = field(repr=False, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def makespan(self) -> float:
        """End of the last iteration (the run starts at 0)."""
        return self.iteration_ends[-1]

    @property
    def num_actions(self) -> int:
        """Actions simulated: lowered actions per iteration × iterations."""
        return len(self.schedule) * self.iterations

    @property
    def bubble_fraction(self) -> float:
        """Σ_r bubble_r / (ranks × iteration_time): idle over total, as :meth:`Timeline.bubble_fraction`."""
        if self.iteration_time <= 0:
            return 0.0
        return sum(self.bubble) / (self.num_ranks * self.iteration_time)

    @cached_property
    def timeline(self) -> Timeline:
        """Compute spans (stream "compute") and non-zero transfers/collectives (stream "comm")."""
        sched, prog = self.schedule, self._program
        spans: list[Span] = []
        for rank, row in enumerate(sched.actions):
            n = len(row)
            modes, durs = prog.modes[rank], prog.durs[rank]
            starts, ends = self._starts[rank], self._ends[rank]
            for it in range(self.iterations):
                base = it * n
                for pos, a in enumerate(row):
                    mode = modes[pos]
                    if mode == _COMPUTE:
                        spans.append(Span(rank, a, starts[base + pos], ends[base + pos], "compute", it))
                    elif mode in (_SEND, _COLLECTIVE) and durs[pos] > 0:
                        spans.append(Span(rank, a, starts[base + pos], ends[base + pos], "comm", it))
        meta = {
            "schedule": sched.name,
            "iterations": self.iterations,
            "iteration_time": self.iteration_time,
            "step_barrier": self.step_barrier,
        }
        return Timeline.of(sched.num_ranks, spans, source="simulated", meta=meta)

    def spans_of(self, rank: int, iteration: int = 0) -> list[tuple[Action, float, float]]:
        """(action, start, end) of every action of ``rank`` in ``iteration`` (sends: transfer times)."""
        row = self.schedule.actions[rank]
        base = iteration * len(row)
        s, e = self._starts[rank], self._ends[rank]
        return [(a, s[base + i], e[base + i]) for i, a in enumerate(row)]


def simulate(
    schedule: Schedule,
    cost: CostModel,
    *,
    comm: CommModel | None = None,
    iterations: int = 1,
    step_barrier: bool = True,
) -> SimResult:
    """Simulate ``iterations`` training iterations of ``schedule`` (lowered first if needed).

    The schedule is not validated here (the CLI validates); a schedule that cannot finish is reported
    with the validator's message.
    """
    if iterations < 1:
        raise SimulationError(f"--iterations must be at least 1 (got {iterations})")
    sched = lower(schedule)
    prog = _compile(sched, cost, comm or FreeComm())
    num_ranks = sched.num_ranks
    lens = [len(row) for row in sched.actions]
    starts = [[0.0] * (n * iterations) for n in lens]
    ends = [[0.0] * (n * iterations) for n in lens]
    clock = [0.0] * num_ranks
    coll_free = [0.0] * num_ranks
    link_free = [0.0] * prog.num_links
    iteration_ends: list[float] = []
    for it in range(iterations):
        etime = _run_iteration(sched, prog, it, lens, clock, coll_free, link_free, starts, ends)
        end = max(max(etime, default=0.0), max(clock, default=0.0))
        iteration_ends.append(end)
        if step_barrier:
            clock = [end] * num_ranks
    if iterations > 1:
        period = (iteration_ends[-1] - iteration_ends[0]) / (iterations - 1)
    else:
        period = iteration_ends[0]
    return SimResult(
        schedule=sched,
        iterations=iterations,
        step_barrier=step_barrier,
        iteration_time=period,
        iteration_ends=tuple(iteration_ends),
        busy=tuple(prog.busy),
        bubble=tuple(period - b for b in prog.busy),
        peak_memory=tuple(prog.peak_memory),
        flops=prog.flops,
        model_flops=prog.model_flops,
        _starts=starts,
        _ends=ends,
        _program=prog,
    )


def _run_iteration(
    sched: Schedule,
    prog: _Program,
    it: int,
    lens: Sequence[int],
    clock: list[float],
    coll_free: list[float],
    link_free: list[float],
    starts: list[list[float]],
    ends: list[list[float]],
) -> list[float]:
    """Advance every rank through one iteration; updates clocks, stream/link state and span times."""
    etime = [_NOT_DONE] * prog.num_events
    waiting: dict[int, list[int]] = {}
    ptr = [0] * len(lens)
    ready = list(range(len(lens) - 1, -1, -1))
    while ready:
        r = ready.pop()
        p, n, t_rank = ptr[r], lens[r], clock[r]
        reqs, outs, modes, durs = prog.reqs[r], prog.outs[r], prog.modes[r], prog.durs[r]
        r_starts, r_ends = starts[r], ends[r]
        base = it * n
        while p < n:
            t = t_rank
            blocked = False
            for e in reqs[p]:
                te = etime[e]
                if te < 0.0:
                    waiting.setdefault(e, []).append(r)
                    blocked = True
                    break
                if te > t:
                    t = te
            if blocked:
                break
            mode = modes[p]
            if mode == _COMPUTE:
                end = t + durs[p]
                t_rank = end
            elif mode == _SEND:
                link = prog.links[r][p]
                free = link_free[link]
                if free > t:
                    t = free
                end = t + durs[p]
                link_free[link] = end
            elif mode == _COLLECTIVE:
                free = coll_free[r]
                if free > t:
                    t = free
                end = t + durs[p]
                coll_free[r] = end
            else:
                end = t_rank = t
            r_starts[base + p] = t
            r_ends[base + p] = end
            for e in outs[p]:
                etime[e] = end
                woken = waiting.pop(e, None)
                if woken:
                    ready.extend(woken)
            p += 1
        ptr[r] = p
        clock[r] = t_rank
    if any(ptr[r] < lens[r] for r in range(len(lens))):
        _report_deadlock(sched, ptr)
    return etime


def _report_deadlock(sched: Schedule, ptr: list[int]) -> None:
    from pipewright.passes.validate import validate

    validate(sched)  # raises a ValidationError naming rank, position and action
    heads = ", ".join(
        f"rank {r} at {sched.actions[r][p]}" for r, p in enumerate(ptr) if p < len(sched.actions[r])
    )
    raise SimulationError(f"{sched.name}: simulation stuck ({heads})")
