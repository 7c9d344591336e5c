"""What the schedule registry (:mod:`pipewright.schedules.registry`) holds per schedule: the generator
and the facts its docstring states (:class:`ScheduleInfo`), and the costs a generator may plan with
(:class:`ScheduleCosts`). The family modules import these, never the registry, which loads them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from pipewright.ir import Schedule


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule generator and the facts its docstring states.

    ``build(p, m, v)`` returns the compute-only schedule. ``chunks`` lists the v values it takes
    (``None``: any v ≥ 1). ``min_microbatches(p, v)`` is the least m it accepts; ``check(p, m, v)`` may
    raise a ScheduleError for further rules (Megatron's m mod N). ``memory(p, m, v)`` gives the peak
    microbatches in flight per rank (activation memory in units of one microbatch of a rank's layers).
    ``order_of``: the schedule whose actions this one repeats exactly (only its ``meta`` differs, e.g.
    the F&B pairs it marks for overlap); None when the order is its own.
    """

    name: str
    build: Callable[[int, int, int], Schedule]
    memory: Callable[[int, int, int], list[Fraction]]
    bubble: str
    memory_formula: str
    source: str
    chunks: tuple[int, ...] | None = (1,)
    default_chunks: int = 1
    min_microbatches: Callable[[int, int], int] = lambda p, v: 1
    check: Callable[[int, int, int], None] | None = None
    synchronous: bool = True
    extra: Mapping[str, object] = field(default_factory=dict)
    build_costed: Callable[[int, int, int, ScheduleCosts], Schedule] | None = None
    order_of: str | None = None


@dataclass(frozen=True)
class ScheduleCosts:
    """Costs a generator may plan with: per-stage (chunk) times of F, I and W (length p·v), the
    point-to-point time of one boundary message and the memory limit in microbatches in flight per rank
    (None: the generator's default); ``refine_time_limit``: seconds a generator that refines its order
    by integer programming (``zb-auto``) may spend on it (None: no refinement)."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    comm: float = 0.0
    memory_limit: float | None = None
    refine_time_limit: float | None = None
