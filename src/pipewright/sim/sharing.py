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
    """One iteration of the compiled program ``prog`` (``engine.Program``) in time order with
    processor sharing. Same contract as ``per_action.run_iteration``: updates the clocks and stream/link
    state, returns start and end times by global action index and each rank's final position (less
    than its row length if the schedule deadlocks)."""
    num_ranks = len(clock)
    host = shared.host_of(num_ranks)
    units = shared.units_per_host(num_ranks)
    shared_hosts = len(shared.hosts)  # hosts beyond these are ranks with a unit of their own
    reqs, modes, durs, links, offsets = prog.reqs, prog.modes, prog.durs, prog.links, prog.offsets
    n_total = prog.missing
    starts = [0.0] * n_total
    ends = [NOT_DONE] * (n_total + 1)
    ptr = offsets[:-1]
    t_rank = list(clock)
    waiting: dict[int, list[int]] = {}
    timers: list[tuple[float, int]] = []  # (time, rank): the rank resumes at that time
    running: list[dict[int, float]] = [{} for _ in units]  # per host: action g → remaining cost
    owner: dict[int, int] = {}  # running action g → its rank
    now = 0.0

    def advance(r: int) -> None:
        """Run rank r's actions from its position at ``now`` until it starts a compute or must wait."""
        g, stop = ptr[r], offsets[r + 1]
        while g < stop:
            t = max(t_rank[r], now)
            for e in reqs[g]:
                te = ends[e]
                if te < 0.0:
                    waiting.setdefault(e, []).append(r)
                    ptr[r] = g
                    return
                t = max(t, te)
            if t > now:
                heapq.heappush(timers, (t, r))
                ptr[r] = g
                return
            mode = modes[g]
            if mode == COMPUTE and durs[g] > 0.0:
                starts[g] = now
                running[host[r]][g] = durs[g]
                owner[g] = r
                ptr[r] = g
                return
            if mode == SEND:
                link = links[g]
                t0 = max(now, link_free[link])
                end = link_free[link] = t0 + durs[g]
            elif mode == COLLECTIVE:
                t0 = max(now, coll_free[r])
                end = coll_free[r] = t0 + durs[g]
            else:  # zero-cost compute or a wait/marker
                t0 = end = t_rank[r] = now
            starts[g] = t0
            finish(g, end)
            g += 1
        ptr[r] = g

    def finish(g: int, end: float) -> None:
        ends[g] = end
        for r in waiting.pop(g, ()):
            heapq.heappush(timers, (max(end, now), r))

    for r in range(num_ranks):
        heapq.heappush(timers, (clock[r], r))
    while True:
        # the next moment something happens: a timer, or the first running action to finish
        t_next = timers[0][0] if timers else float("inf")
        rates = [
            (shared.rate(len(jobs), units[h]) if h < shared_hosts else 1.0) if jobs else 0.0
            for h, jobs in enumerate(running)
        ]
        for h, jobs in enumerate(running):
            if jobs:
                t_next = min(t_next, now + min(jobs.values()) / rates[h])
        if t_next == float("inf"):
            break
        dt = t_next - now
        now = t_next
        done: list[int] = []
        for h, jobs in enumerate(running):
            if not jobs:
                continue
            work = dt * rates[h]
            for g in jobs:
                left = jobs[g] - work
                # relative tolerance: the finishing action's own remainder rounds to ~0
                if left <= 1e-12 * max(1.0, durs[g]):
                    done.append(g)
                else:
                    jobs[g] = left
            for g in done:
                jobs.pop(g, None)
        for g in sorted(done):
            r = owner.pop(g)
            t_rank[r] = now
            finish(g, now)
            ptr[r] = g + 1
            heapq.heappush(timers, (now, r))
        while timers and timers[0][0] <= now:
            _, r = heapq.heappop(timers)
            if ptr[r] < offsets[r + 1] and ptr[r] not in owner:
                advance(r)
    for r in range(num_ranks):
        clock[r] = t_rank[r]
    ends.pop()
    return starts, ends, [ptr[r] - offsets[r] for r in range(num_ranks)]


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
