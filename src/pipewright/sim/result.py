"""What :func:`pipewright.sim.engine.simulate` returns: the metrics of the simulated iterations, with the
lowered schedule, the times of every action and the timeline built on first access."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pipewright.ir import Action, Schedule
from pipewright.passes.lower import lower
from pipewright.sim.compiled import COLLECTIVE, COMPUTE, RENDEZVOUS, SEND, Program
from pipewright.sim.fast_loop import StepTimes

if TYPE_CHECKING:  # imported where used: timelines are not every run's
    from pipewright.timeline import Timeline


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts. Times are in the cost model's unit (seconds for real models).

    ``iteration_time``: steady-state period (end of last iteration − end of first) / (iterations − 1),
    or the makespan for one iteration. ``busy[r]``: compute time of rank r in one iteration;
    ``bubble[r] = iteration_time − busy[r]``. ``peak_memory[r]``: static bytes + the highest running
    sum of activation bytes over the rank's compute actions. ``flops`` / ``model_flops``: per iteration
    (with / without recomputation). ``iteration_ends[k]``: when iteration k's last action finished.
    ``source``: the schedule as given (or as lowered by the reference path); :attr:`schedule`, the
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
    _program: Program = field(repr=False, compare=False)

    @cached_property
    def schedule(self) -> Schedule:
        """The lowered schedule that was simulated (built on first access when the fast path,
        :mod:`pipewright.sim.lowered_compile`, simulated it without one)."""
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
                    if mode == COMPUTE:
                        spans.append(Span(rank, a, starts[g], ends[g], "compute", it))
                    elif mode in (SEND, COLLECTIVE, RENDEZVOUS) and prog.durs[g] > 0:
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
