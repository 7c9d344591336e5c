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

Two paths, one result (``tests/test_sim_fast_path.py`` checks that they agree to the bit on every
registered schedule):

- the **fast path** compiles over integer arrays, with no Python object per lowered action — from the
  compute actions alone (:mod:`pipewright.sim.compute_compile`) or, when that declines, over the
  lowered actions (:mod:`pipewright.sim.lowered_compile`; both share :mod:`pipewright.sim.array_coding`)
  — and runs the compute-only loop (:mod:`pipewright.sim.fast_loop`);
- the **reference path** (:mod:`pipewright.sim.reference`) lowers with
  :func:`pipewright.passes.lower.lower`, resolves with :func:`pipewright.deps.resolve` (the validator's
  resolution) and runs one lowered action at a time. It runs whatever the fast path declines (it names
  what is wrong: collectives across pipeline ranks among the rest), and its loop runs the rare
  fast-compiled program the compute-only loop does not take (a marker with several requirements, a
  send with requirements of its own). Shared cores (:mod:`pipewright.sim.sharing`) run in time order
  over the same program.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.ir import Schedule
from pipewright.sim.array_coding import Decline
from pipewright.sim.compiled import Program, SimulationError, gc_paused
from pipewright.sim.compute_compile import ComputeProgram, compile_compute
from pipewright.sim.fast_loop import StepTimes, run_steps
from pipewright.sim.lowered_compile import compile_lowered
from pipewright.sim.result import SimResult

if TYPE_CHECKING:  # imported where used: shared cores and the reference path are not every run's
    from pipewright.sim.sharing import SharedCompute

__all__ = ["SimResult", "SimulationError", "compile_fast", "simulate"]


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

    The fast path (:func:`compile_fast`) is tried first; when it declines, the reference path lowers,
    resolves (:func:`pipewright.deps.resolve`, shared by the validator and the compile) and names
    whatever is wrong (module docstring).
    """
    if iterations < 1:
        raise SimulationError(f"--iterations must be at least 1 (got {iterations})")
    with gc_paused():
        return _simulate(schedule, cost, comm or FreeComm(), iterations, step_barrier, shared, validate)


def compile_fast(
    schedule: Schedule, cost: CostModel, comm: CommModel, *, check: bool = True, fold: bool = True
) -> tuple[Program | ComputeProgram, Schedule | None] | None:
    """The fast path's compile: ``(program, lowered schedule or None)`` of ``schedule`` (lowered here if
    it is not), or None when it declines. ``check``: also the validator's completeness and send/receive
    checks. The lowered schedule is returned only when a per-action rule made it necessary (else it is
    built on demand, see :attr:`SimResult.schedule`). ``fold``: first try the compile from the compute
    actions alone (:mod:`pipewright.sim.compute_compile`; its lowered program on first use)."""

    def lowered() -> Program:
        return compile_lowered(schedule, cost, comm, False)[0]

    try:
        if fold:
            return compile_compute(schedule, cost, comm, check, lowered), None
    except Decline:
        pass
    try:
        return compile_lowered(schedule, cost, comm, check)
    except Decline:
        return None


def _compile(schedule: Schedule, cost: CostModel, comm: CommModel, validate: bool):
    """(program, lowered schedule or the schedule as given): the fast path's, else the reference's."""
    fast = compile_fast(schedule, cost, comm, check=validate)
    if fast is not None:  # no per-action objects, the lowered schedule on demand
        return fast[0], fast[1] or schedule
    from pipewright.passes.lower import lower
    from pipewright.passes.validate import validate_resolved
    from pipewright.sim.reference import compile_actions

    sched = lower(schedule)
    return compile_actions(sched, cost, comm, validate_resolved(sched) if validate else None), sched


class _State:
    """What carries from one iteration to the next: the ranks' clocks and the free times of their
    collective streams (the reference loop's; the fast loop's follow the links in ``link_free``), of
    the links and of the rendezvous streams."""

    def __init__(self, num_ranks: int, num_links: int) -> None:
        self.clock = [0.0] * num_ranks
        self.coll_free = [0.0] * num_ranks
        self.link_free = [0.0] * num_links
        self.meet_free: dict[tuple[int, str], float] = {}


def _iteration(sched: Schedule, prog, state: _State, shared: SharedCompute | None):
    """One iteration from ``state`` (updated): (starts, ends, the latest end) — StepTimes for both
    from the compute-only loop (times expanded on demand)."""
    steps = prog.steps if shared is None else None
    done = run_steps(steps, state.clock, state.link_free) if steps is not None else None
    if done is not None:  # the fast loop: a compute action ends by its rank's clock, a send by its link
        times = StepTimes(steps, done[0], list(state.clock), list(state.link_free))
        state.clock[:], state.link_free[:] = done[1], done[2]
        return times, times, max(max(state.link_free, default=0.0), max(state.clock, default=0.0))
    if shared is None:
        from pipewright.sim.reference import run_iteration

        args = (state.clock, state.coll_free, state.link_free, state.meet_free)
        starts, ends = run_iteration(sched, prog.listed, *args)
    else:
        if prog.meets:
            raise SimulationError(
                f"{sched.name}: collectives across pipeline ranks are not simulated with shared "
                "cores yet; drop --cores"
            )
        from pipewright.sim.reference import report_deadlock
        from pipewright.sim.sharing import run_iteration_shared

        args = (state.clock, state.coll_free, state.link_free, shared)
        starts, ends, positions = run_iteration_shared(prog.listed, *args)
        if any(p < prog.offsets[r + 1] - prog.offsets[r] for r, p in enumerate(positions)):
            report_deadlock(sched, list(positions))
    return starts, ends, max(max(ends, default=0.0), max(state.clock, default=0.0))


def _simulate(
    schedule: Schedule,
    cost: CostModel,
    comm: CommModel,
    iterations: int,
    step_barrier: bool,
    shared: SharedCompute | None,
    validate: bool,
) -> SimResult:
    prog, sched = _compile(schedule, cost, comm, validate)
    state = _State(sched.num_ranks, prog.num_links + sched.num_ranks)  # links, then collective streams
    all_starts: list[list[float] | StepTimes] = []  # per iteration, as SimResult._starts
    all_ends: list[list[float] | StepTimes] = []
    iteration_ends: list[float] = []
    for _ in range(iterations):
        starts, ends, end = _iteration(sched, prog, state, shared)
        all_starts.append(starts)
        all_ends.append(ends)
        iteration_ends.append(end)
        if step_barrier:
            state.clock = [end] * sched.num_ranks
    if iterations > 1:
        period = (iteration_ends[-1] - iteration_ends[0]) / (iterations - 1)
    else:
        period = iteration_ends[0]
    if shared is None:
        busy = prog.busy
    else:
        from pipewright.sim.reference import computing_time

        busy = computing_time(prog.listed, all_starts[-1], all_ends[-1])
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
