"""The compiled form of a lowered schedule that the simulator's event loop runs.

Both paths compile to it: the reference (:func:`pipewright.sim.reference.compile_actions`, from the
per-action dependency resolution :func:`pipewright.deps.resolve`) and the fast path
(:func:`pipewright.sim.lowered_compile.compile_lowered`, from integer arrays). Actions are numbered
globally, rank by rank: ``g = offsets[rank] + position``. Also here: the action modes, the
simulator's error and :func:`gc_paused`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from pipewright.errors import PipewrightError
from pipewright.kinds import KindSpec

# Action modes in the compiled program.
COMPUTE, SEND, COLLECTIVE, WAIT, RENDEZVOUS = 0, 1, 2, 3, 4
#: The end time of an action that has not run yet (every real time is ≥ 0).
NOT_DONE = -1.0


class SimulationError(PipewrightError):
    """The schedule cannot be simulated (it deadlocks or an option is invalid)."""


@dataclass(frozen=True)
class Program:
    """A lowered schedule compiled to flat arrays over global action indices g = offset[rank] + position.

    An event is identified with the action that produces it, so :attr:`reqs` ``[g]`` lists the global
    indices of the actions whose completion action g waits for (``missing``: an index no action has,
    for requirements nothing produces), and the end time of action g is the time of all its events.
    They are stored flat, as almost every action waits for at most one other: ``req1[g]`` is that
    action's index, −1 for none, −2 for several, which ``extra[g]`` lists (no tuple per action).

    The fast path (:mod:`pipewright.sim.lowered_compile`) gives ``modes``, ``durs`` and ``links`` as
    numpy arrays and the requirements as ``pairs`` (consumer, producer) arrays instead of
    ``req1``/``extra``, with ``steps`` (:class:`pipewright.sim.fast_loop.Steps`) when the compute-only
    loop can run it; the reference and shared-cores loops read :attr:`listed`, these as lists, built on
    first access.
    """

    offsets: list[int]
    req1: list[int] | None
    extra: dict[int, tuple[int, ...]] | None
    modes: Any  # list[int] (or an array, see above)
    durs: Any  # list[float]
    links: Any  # list[int]: link index of a send, -1 otherwise
    num_links: int
    busy: list[float]  # compute time of one iteration per rank
    flops: float
    model_flops: float
    peak_memory: list[float]
    # rendezvous collectives: g -> the global indices of all members' actions (g included), and the
    # previous rendezvous of the same rank and group (-1: none in this iteration; key: (rank, group))
    meets: dict[int, tuple[int, ...]] = field(default_factory=dict)
    meet_prev: dict[int, int] = field(default_factory=dict)
    meet_stream: dict[int, tuple[int, str]] = field(default_factory=dict)
    pairs: Any = None  # (consumers, producers) arrays when req1 is None
    steps: Any = None  # the compute-only form (pipewright.sim.fast_loop.Steps), when it applies

    @property
    def missing(self) -> int:
        return len(self.modes)

    @cached_property
    def listed(self) -> Program:
        """This program with every per-action column a list (itself when they already are)."""
        if self.req1 is not None and isinstance(self.modes, list):
            return self
        req1, extra = self.req1, self.extra
        if req1 is None:
            req1, extra = _flat_pairs(*self.pairs, len(self.modes))
        return replace(
            self,
            req1=req1,
            extra=extra,
            modes=self.modes.tolist(),
            durs=self.durs.tolist(),
            links=self.links.tolist(),
            pairs=None,
        )

    @property
    def reqs(self) -> list[tuple[int, ...]]:
        """Per action, the producers it waits for (built from :attr:`req1` and :attr:`extra`)."""
        extra = self.extra
        return [() if e == -1 else (e,) if e >= 0 else extra[g] for g, e in enumerate(self.req1)]


def flat_requirements(reqs: list[tuple[int, ...]]) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """``(req1, extra)`` of per-action requirement tuples (:class:`Program`'s flat form)."""
    req1 = [e[0] if len(e) == 1 else -1 if not e else -2 for e in reqs]
    return req1, {g: e for g, e in enumerate(reqs) if len(e) > 1}


def one_or_several(keys, values, count: int):
    """Per key below ``count``, its one value (an array: −1 for none, −2 for several) and, for keys
    with several, their values as tuples in the given order — of equal-length numpy arrays."""
    import numpy as np

    per_key = np.bincount(keys, minlength=count)
    one = per_key[keys] == 1
    first = np.full(count, -1, values.dtype if values.dtype.kind == "i" else np.int64)
    first[keys[one]] = values[one]
    first[per_key > 1] = -2
    several: dict[int, tuple[int, ...]] = {}
    for k, v in zip(keys[~one].tolist(), values[~one].tolist(), strict=True):
        several[k] = (*several.get(k, ()), v)
    return first, several


def first_missing(events: tuple[int, ...], ends: list[float], t: float) -> tuple[int, float]:
    """Of an action waiting for several ``events`` from clock ``t``: (−1, its start: max of ``t`` and
    their ends) when all have ended, else (the first that has not — ``ends`` < 0 —, ``t``)."""
    for e in events:
        te = ends[e]
        if te < 0.0:
            return e, t
        if te > t:
            t = te
    return -1, t


def _flat_pairs(rg, need, n: int) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """``(req1, extra)`` of (consumer, producer) index arrays in requirement order (numpy)."""
    first, extra = one_or_several(rg, need, n)
    return first.tolist(), extra


def action_mode(spec: KindSpec) -> int:
    if spec.compute:
        return COMPUTE
    if spec.collective is not None:
        return RENDEZVOUS if spec.collective.spans_pipeline else COLLECTIVE
    return SEND if spec.comm == "send" else WAIT


@contextmanager
def gc_paused(*, freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector. Simulating builds hundreds of thousands of small tuples that
    hold no cycles; each collection would traverse all of them again (≈ 30 % of a large simulation).
    ``freeze``: move the objects made meanwhile out of the collector's sight before it resumes (a
    command that is about to exit), so that resuming triggers no collection over them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if freeze:
                gc.freeze()
            gc.enable()
