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

from typing import TYPE_CHECKING

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.ir import Schedule
from pipewright.sim.flat import compile_flat
from pipewright.sim.program import SimulationError, gc_paused
from pipewright.sim.result import SimResult
from pipewright.sim.steps import StepTimes, run_steps

if TYPE_CHECKING:  # imported where used: shared cores and the per-action path are not every run's
    from pipewright.sim.sharing import SharedCompute

__all__ = ["SimResult", "SimulationError", "compile_flat", "simulate"]


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
        from pipewright.passes.lower import lower
        from pipewright.passes.validate import validate_resolved
        from pipewright.sim.per_action import compile_actions

        sched = lower(schedule)
        res = validate_resolved(sched) if validate else None
        prog = compile_actions(sched, cost, comm, res)
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
            from pipewright.sim.per_action import run_iteration

            starts, ends = run_iteration(sched, prog.listed, clock, coll_free, link_free, meet_free)
        else:
            if prog.meets:
                raise SimulationError(
                    f"{sched.name}: collectives across pipeline ranks are not simulated with shared "
                    "cores yet; drop --cores"
                )
            from pipewright.sim.per_action import report_deadlock
            from pipewright.sim.sharing import run_iteration_shared

            starts, ends, positions = run_iteration_shared(prog.listed, clock, coll_free, link_free, shared)
            if any(p < prog.offsets[r + 1] - prog.offsets[r] for r, p in enumerate(positions)):
                report_deadlock(sched, list(positions))
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
    if shared is None:
        busy = prog.busy
    else:
        from pipewright.sim.per_action import computing_time

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
