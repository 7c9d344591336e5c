"""The reference implementation's pass order as a candidate of the insertion pass (pure Python).

On plain 1F1B (stage r on rank r, m > p) Algorithms 1 and 2 have the authors' order
(:mod:`.reference_order`: T(k − 1) fused with S(k), S before or after the forward at the offsets the
reference derives from the forward and backward times f and b, the embedding forwards spread over the
steady state). :func:`reference_candidate` builds it on the given schedule, with f and b the mean
forward and backward times over the stages of the placement costs, as the reference's timers average
them over the ranks; it is offered only when the reference would run it (b ≥ f ≥ the embedding
forward's time) and when the memory allowance covers its warm-up (p + 1 microbatches for Algorithm 2,
p + 2 for Algorithm 1). :func:`simulated_span` scores a placement in the simulator under the same
placement costs, so the insertion pass keeps whichever order the simulator predicts no slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.rules import ActionCost, RuledCost
from pipewright.cost.unit import UnitCost
from pipewright.features.vocab.kinds import GROUPS, VEF, registry
from pipewright.features.vocab.reference_order import REFERENCE_ALGORITHMS, reference_schedule
from pipewright.ir import Action, B, F, I, Schedule, W

#: microbatches the reference runs ahead of 1F1B on the first rank (its extra warm-up forwards)
REFERENCE_EXTRA = {"alg1": 2, "alg2": 1}
_BASE = (F, B, I, W)
_KIND_OF_GROUP = {group: kind for kind, (_, group) in GROUPS.items()}


@dataclass(frozen=True)
class _PlacementComm:
    """Communication from placement costs: one stage-boundary transfer time, each vocabulary
    collective's time by its group."""

    costs: object

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return float(self.costs.p2p)

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        return float(self.costs.collective.get(_KIND_OF_GROUP.get(group, ""), 0.0))


def simulated_span(schedule: Schedule, costs) -> float:
    """One iteration of ``schedule`` in the simulator under placement costs ``costs`` (every compute
    action's time from ``costs.compute``; no memory or FLOPs are needed)."""
    from pipewright.sim.engine import simulate

    def rule(action: Action, sched: Schedule, base) -> ActionCost:
        return ActionCost(time=float(costs.compute(action)))

    kinds = [name for name, spec in schedule.kinds.items() if spec.compute]
    cost = RuledCost(UnitCost(), dict.fromkeys(kinds, rule))
    return simulate(schedule, cost, comm=_PlacementComm(costs)).makespan


def _is_plain_1f1b(schedule: Schedule) -> bool:
    from pipewright.schedules import build_schedule

    p, m = schedule.num_ranks, schedule.num_microbatches
    if schedule.num_stages != p or list(schedule.placement) != list(range(p)) or m <= p:
        return False
    plain = build_schedule("1f1b", p, m)
    return all(
        [a for a in row if a.kind in _BASE] == list(ref)
        for row, ref in zip(schedule.actions, plain.actions, strict=True)
    )


def reference_candidate(schedule: Schedule, algorithm: str, costs, allowance: int) -> Schedule | None:
    """``schedule`` with the vocabulary passes in the reference's order, or None where the reference
    does not apply (not plain 1F1B with m > p, the naive algorithm, an allowance below the reference's
    warm-up, or times the reference refuses: b < f or f below the embedding forward)."""
    if algorithm not in REFERENCE_ALGORITHMS or allowance < REFERENCE_EXTRA[algorithm]:
        return None
    if not _is_plain_1f1b(schedule):
        return None
    p = schedule.num_ranks
    f = sum(float(costs.compute(Action(s, F, 0))) for s in range(p)) / p
    b = sum(float(costs.compute(Action(s, B, 0))) for s in range(p)) / p
    c = max(float(costs.compute(Action(r, VEF, 0))) for r in range(p))
    if not (b >= f >= c and f > 0):
        return None
    ref = reference_schedule(p, schedule.num_microbatches, f, b, algorithm)
    tail = [[a for a in row if a.kind not in _BASE] for row in schedule.actions]
    rows = [list(row) + extra for row, extra in zip(ref.actions, tail, strict=True)]
    meta = {
        **schedule.meta,
        "vocab_parallel": algorithm,
        "vocab_order": "reference",
        "vocab_shift": REFERENCE_EXTRA[algorithm],
    }
    return schedule.with_actions(rows, lowered=False, kinds=registry(algorithm, schedule.kinds), meta=meta)
