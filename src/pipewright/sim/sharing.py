"""Ranks that share compute units: processor sharing for oversubscribed hosts.

The default simulator gives every rank its own compute unit (a GPU, or a dedicated CPU core): an
action lasts exactly its cost. When several ranks share fewer units — p single-threaded CPU workers on
a host with C < p cores, or several ranks on one GPU — the operating system time-slices them. This
module models that as **processor sharing** (Kleinrock, *Queueing Systems* vol. 2, §4.4): while n
compute actions of one host are running, each progresses at rate

    rate(n) = min(1, C / n)

(in units of its dedicated-unit cost per second), so n ≤ C actions run at full speed and n > C split
the C units evenly; a host's work is conserved. Real hosts lose some of it — busy cores share memory
bandwidth and caches, time slicing costs context switches — so a measured curve ``s(n)`` (the time of
an action while n processes compute, relative to the profile's conditions; ``pipewright profile
--contention N`` measures it by throughput) can replace the ideal ``max(1, n / C)``:
rate(n) = 1 / s(n). An idle rank (in its bubble, or waiting on a receive) leaves its share to the
others — which is why a profile taken with every worker busy overestimates a pipeline's step on an
oversubscribed host, and a dedicated-core profile underestimates it.

Durations now depend on what the other ranks of the host do at the same moment, so the iteration is
evaluated in time order (an event loop over compute completions and known transfer arrivals) instead
of the max-plus order of :mod:`pipewright.sim.engine`. With a unit per rank it gives exactly the
engine's times (tested). Transfers and collectives keep their costs (the network is not shared).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipewright.errors import PipewrightError
from pipewright.sim.compiled import COLLECTIVE, COMPUTE, NOT_DONE, SEND


@dataclass(frozen=True)
class SharedCompute:
    """Which ranks share how many compute units, and how much one busy process slows the others.

    ``hosts[h]``: the ranks of host h; ``units[h]``: its compute units (CPU cores). A rank in no host
    has a unit of its own. ``processes_per_rank``: processes one simulated rank stands for (with tensor
    × data parallelism a pipeline rank is ``tp · dp`` processes computing at once).

    ``slowdown``: measured ``s(k)``, the time of an action while k processes of the host compute,
    relative to the profile the costs come from (``pipewright profile`` measures it; beyond the
    table s grows as k / len(table)). Without it, ideal sharing: ``s(k) = max(1, k / units)``.
    While n ranks of a host compute, each progresses at rate ``1 / s(n · processes_per_rank)``.
    """

    hosts: tuple[tuple[int, ...], ...]
    units: tuple[float, ...]
    slowdown: tuple[float, ...] | None = None
    processes_per_rank: int = 1

    def __post_init__(self) -> None:
        if len(self.hosts) != len(self.units):
            raise PipewrightError(f"{len(self.hosts)} hosts but {len(self.units)} unit counts")
        seen: set[int] = set()
        for ranks, units in zip(self.hosts, self.units, strict=True):
            if not units > 0:
                raise PipewrightError(f"a host needs a positive number of compute units (got {units})")
            if seen & set(ranks):
                raise PipewrightError(f"rank(s) {sorted(seen & set(ranks))} are on more than one host")
            seen |= set(ranks)
        if self.slowdown is not None and (not self.slowdown or min(self.slowdown) <= 0):
            raise PipewrightError(f"slowdown factors must be positive (got {self.slowdown})")
        if self.processes_per_rank < 1:
            raise PipewrightError(f"processes_per_rank must be at least 1 (got {self.processes_per_rank})")

    def rate(self, busy_ranks: int, units: float) -> float:
        """Progress rate of each of ``busy_ranks`` computing ranks on a host of ``units`` units."""
        k = busy_ranks * self.processes_per_rank
        table = self.slowdown
        if table is None:
            return min(1.0, units / k)
        s = table[k - 1] if k <= len(table) else table[-1] * k / len(table)
        return 1.0 / s

    @classmethod
    def one_host(
        cls,
        num_ranks: int,
        units: float,
        slowdown: tuple[float, ...] | None = None,
        processes_per_rank: int = 1,
    ) -> SharedCompute:
        """All ``num_ranks`` ranks on one host with ``units`` compute units."""
        return cls((tuple(range(num_ranks)),), (float(units),), slowdown, processes_per_rank)

    @classmethod
    def from_profile(
        cls,
        num_ranks: int,
        cores: float,
        meta: Mapping[str, str],
        processes_per_rank: int = 1,
    ) -> SharedCompute:
        """All ranks on one host of ``cores`` cores, with the contention curve of a profile's header
        (``contention=s(1),…`` measured by ``pipewright profile --contention``) taken relative to the
        ``workers`` busy processes the profile's times were measured under; ideal sharing without one."""
        slowdown = None
        if meta.get("contention"):
            try:
                curve = [float(x) for x in str(meta["contention"]).split(",")]
                measured_under = int(meta.get("workers", "1"))
            except ValueError:
                raise PipewrightError(
                    f"bad contention curve in the profile: {meta['contention']!r}"
                ) from None
            ref = curve[min(max(measured_under, 1), len(curve)) - 1]
            slowdown = tuple(x / ref for x in curve)
        return cls.one_host(num_ranks, cores, slowdown, processes_per_rank)

    def host_of(self, num_ranks: int) -> list[int]:
        """Host index per rank (ranks in no host get a host of their own, index ≥ len(hosts))."""
        out = [-1] * num_ranks
        for h, ranks in enumerate(self.hosts):
            for r in ranks:
                if r >= num_ranks:
                    raise PipewrightError(f"host {h} names rank {r} but the schedule has {num_ranks} ranks")
                out[r] = h
        extra = len(self.hosts)
        for r in range(num_ranks):
            if out[r] < 0:
                out[r], extra = extra, extra + 1
        return out

    def units_per_host(self, num_ranks: int) -> list[float]:
        hosts = self.host_of(num_ranks)
        return list(self.units) + [1.0] * (max(hosts, default=-1) + 1 - len(self.units))


def run_iteration_shared(
    prog,
    clock: list[float],
    coll_free: list[float],
    link_free: list[float],
    shared: SharedCompute,
) -> tuple[list[float], list[float], Sequence[int]]:
    """One iteration of the compiled program ``prog`` (:class:`pipewright.sim.compiled.Program`) in
    time order with processor sharing. Same contract as :func:`pipewright.sim.reference.run_iteration`:
    updates the clocks and stream/link state, returns start and end times by global action index and
    each rank's final position (less than its row length if the schedule deadlocks)."""
    run = _SharedIteration(prog, clock, coll_free, link_free, shared)
    for r in range(len(clock)):
        heapq.heappush(run.timers, (clock[r], r))
    while run.step():
        pass
    clock[:] = run.t_rank
    run.ends.pop()
    offsets = prog.offsets
    return run.starts, run.ends, [run.ptr[r] - offsets[r] for r in range(len(clock))]


class _SharedIteration:
    """The state of :func:`run_iteration_shared`: the time ``now``, each rank's position and clock, the
    compute actions running on each host with their remaining cost, and the timers (time, rank) at
    which a rank resumes."""

    def __init__(self, prog, clock, coll_free, link_free, shared: SharedCompute) -> None:
        num_ranks = len(clock)
        self.prog, self.coll_free, self.link_free, self.shared = prog, coll_free, link_free, shared
        self.host = shared.host_of(num_ranks)
        self.units = shared.units_per_host(num_ranks)
        self.shared_hosts = len(shared.hosts)  # hosts beyond these are ranks with a unit of their own
        self.reqs = prog.reqs
        self.starts = [0.0] * prog.missing
        self.ends = [NOT_DONE] * (prog.missing + 1)
        self.ptr = prog.offsets[:-1]
        self.t_rank = list(clock)
        self.waiting: dict[int, list[int]] = {}
        self.timers: list[tuple[float, int]] = []  # (time, rank): the rank resumes at that time
        self.running: list[dict[int, float]] = [{} for _ in self.units]  # per host: g → remaining cost
        self.owner: dict[int, int] = {}  # running action g → its rank
        self.now = 0.0

    def advance(self, r: int) -> None:
        """Run rank r's actions from its position at ``now`` until it starts a compute or must wait."""
        prog, now, ends = self.prog, self.now, self.ends
        g, stop = self.ptr[r], prog.offsets[r + 1]
        while g < stop:
            t = max(self.t_rank[r], now)
            for e in self.reqs[g]:
                te = ends[e]
                if te < 0.0:
                    self.waiting.setdefault(e, []).append(r)
                    self.ptr[r] = g
                    return
                t = max(t, te)
            if t > now:
                heapq.heappush(self.timers, (t, r))
                self.ptr[r] = g
                return
            mode, dur = prog.modes[g], prog.durs[g]
            if mode == COMPUTE and dur > 0.0:
                self.starts[g] = now
                self.running[self.host[r]][g] = dur
                self.owner[g] = r
                self.ptr[r] = g
                return
            if mode == SEND:
                link = prog.links[g]
                t0 = max(now, self.link_free[link])
                end = self.link_free[link] = t0 + dur
            elif mode == COLLECTIVE:
                t0 = max(now, self.coll_free[r])
                end = self.coll_free[r] = t0 + dur
            else:  # zero-cost compute or a wait/marker
                t0 = end = self.t_rank[r] = now
            self.starts[g] = t0
            self.finish(g, end)
            g += 1
        self.ptr[r] = g

    def finish(self, g: int, end: float) -> None:
        self.ends[g] = end
        for r in self.waiting.pop(g, ()):
            heapq.heappush(self.timers, (max(end, self.now), r))

    def step(self) -> bool:
        """Go to the next moment something happens (a timer, or the first running action to finish) and
        handle it; False when nothing is left."""
        shared, units, running, timers = self.shared, self.units, self.running, self.timers
        t_next = timers[0][0] if timers else float("inf")
        rates = [
            (shared.rate(len(jobs), units[h]) if h < self.shared_hosts else 1.0) if jobs else 0.0
            for h, jobs in enumerate(running)
        ]
        for h, jobs in enumerate(running):
            if jobs:
                t_next = min(t_next, self.now + min(jobs.values()) / rates[h])
        if t_next == float("inf"):
            return False
        dt = t_next - self.now
        self.now = now = t_next
        done: list[int] = []
        for h, jobs in enumerate(running):
            if not jobs:
                continue
            work = dt * rates[h]
            for g in jobs:
                left = jobs[g] - work
                # relative tolerance: the finishing action's own remainder rounds to ~0
                if left <= 1e-12 * max(1.0, self.prog.durs[g]):
                    done.append(g)
                else:
                    jobs[g] = left
            for g in done:
                jobs.pop(g, None)
        for g in sorted(done):
            r = self.owner.pop(g)
            self.t_rank[r] = now
            self.finish(g, now)
            self.ptr[r] = g + 1
            heapq.heappush(timers, (now, r))
        while timers and timers[0][0] <= now:
            _, r = heapq.heappop(timers)
            if self.ptr[r] < self.prog.offsets[r + 1] and self.ptr[r] not in self.owner:
                self.advance(r)
        return True


def makespan_together(works: Sequence[float], shared: SharedCompute, host: int = 0) -> float:
    """When the ranks of ``host`` start jobs of costs ``works`` at the same moment (e.g. the optimizer
    step after a flush), the time the last one finishes: with n jobs left each runs at
    ``shared.rate(n)``, so they finish shortest first."""
    units = shared.units[host]
    t = done = 0.0
    left = sorted(works)
    for i, w in enumerate(left):
        t += (w - done) / shared.rate(len(left) - i, units)
        done = w
    return t
