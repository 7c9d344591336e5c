"""Weight memory of each policy per stage (pure Python: usable by the simulator and cost side).

Versions held at peak, the live weights included (what :class:`.runtime.AsyncRuntime` reports as
``weight_versions``):

========  ==========================================  =====================================
policy    versions on stage s                         1F1B without flush, rank r of p
========  ==========================================  =====================================
none      1                                           1
stash     distinct versions in flight (schedule)      p − r (m ≥ 2p; fewer at m = p)
dc        in flight until the microbatch's own STEP   p − r (async-zb-h1: 4 4 4 1 at p = 4)
2bw       2 with a pipeline (1 with one stage)        2
predict   2 if the stage has s > 0 (Ŵ buffer), else 1 2 (1 on the last stage)
========  ==========================================  =====================================

``predict`` also keeps the latest gradient for D(W) (one gradient-sized buffer that a synchronous
run frees after the step); the optimizer state itself is the same for every policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from pipewright.features.async_weights.staleness import steady_staleness, versions_in_flight
from pipewright.ir import Schedule


def _delayed(schedule: Schedule) -> bool:
    return any(steady_staleness(schedule).values())


#: policy → fn(schedule) → {stage: weight versions held at peak, live included}.
WEIGHT_VERSIONS: Mapping[str, Callable[[Schedule], dict[int, int]]] = MappingProxyType(
    {
        "none": lambda sched: dict.fromkeys(range(sched.num_stages), 1),
        "stash": versions_in_flight,
        "nesterov": versions_in_flight,
        "dc": lambda sched: versions_in_flight(sched, until_step=True),
        "2bw": lambda sched: dict.fromkeys(range(sched.num_stages), 2 if _delayed(sched) else 1),
        "predict": lambda sched: {s: 2 if d > 0 else 1 for s, d in steady_staleness(sched).items()},
    }
)

#: policy → extra gradient-sized buffers kept between updates.
EXTRA_GRADIENTS: Mapping[str, int] = MappingProxyType(
    {"none": 0, "stash": 0, "dc": 1, "2bw": 0, "predict": 1, "nesterov": 0}
)


def weight_versions(policy: str, schedule: Schedule) -> dict[int, int]:
    """Weight versions each stage holds at peak under ``policy`` (see the module table)."""
    return WEIGHT_VERSIONS[policy](schedule)


def weight_bytes(policy: str, schedule: Schedule, param_bytes: Mapping[int, float]) -> dict[int, float]:
    """Bytes of weights (versions × the stage's parameter bytes) plus the extra gradient buffers
    (``param_bytes`` in the weights' dtype; gradients assumed the same size)."""
    versions = weight_versions(policy, schedule)
    extra = EXTRA_GRADIENTS[policy]
    return {s: (versions[s] + extra) * param_bytes[s] for s in versions}
