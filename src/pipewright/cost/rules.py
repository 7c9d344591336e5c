"""Cost rules keyed by action kind: how features price their own kinds.

A rule is ``rule(action, schedule, base) -> ActionCost``; ``base`` is the cost model the rule sits in
front of, so a rule can read the model's dimensions (``base.spec``, ``base.microbatch``, …).
:class:`RuledCost` is a :class:`~pipewright.cost.base.CostModel` that asks the rule registered for an
action's kind and, for every other kind, the base model.

The one fallback, for a kind that neither a rule nor the base model knows: the base model's own
answer for unknown kinds, which every model in :mod:`pipewright.cost` gives the same way — zero bytes
and zero FLOPs, and a compute time of ``extra_times[kind]`` / a profile row named after the kind when
the user gave one, else 0 (``--cost unit``: 1, the documented unit convention for extension tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipewright.ir import Action, Schedule


@dataclass(frozen=True)
class ActionCost:
    """What one action costs: seconds on the compute stream (compute kinds), FLOPs executed and
    model FLOPs (None: the same), activation bytes it adds (+) or frees (−), and the bytes a
    communication kind moves per device."""

    time: float = 0.0
    flops: float = 0.0
    model_flops: float | None = None
    activation_bytes: float = 0.0
    message_bytes: float = 0.0


CostRule = Callable[[Action, Schedule, Any], ActionCost]


@dataclass(frozen=True, eq=False)
class RuledCost:
    """``base`` with ``rules`` (kind → :data:`CostRule`) in front (the simulator asks each compute
    cost once per kind, stage and payload)."""

    base: Any
    rules: Mapping[str, CostRule]

    def __getattr__(self, name: str) -> Any:  # the base model's other attributes (spec, topology, …)
        if name in ("base", "rules"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def _cost(self, action: Action, schedule: Schedule) -> ActionCost | None:
        rule = self.rules.get(action.kind)
        return None if rule is None else rule(action, schedule, self.base)

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        c = self._cost(action, schedule)
        return self.base.compute_time(action, schedule) if c is None else c.time

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        c = self._cost(action, schedule)
        return self.base.message_bytes(action, schedule) if c is None else c.message_bytes

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        c = self._cost(action, schedule)
        return self.base.activation_bytes(action, schedule) if c is None else c.activation_bytes

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return self.base.static_bytes(rank, schedule)

    def flops(self, action: Action, schedule: Schedule) -> float:
        c = self._cost(action, schedule)
        return self.base.flops(action, schedule) if c is None else c.flops

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        c = self._cost(action, schedule)
        if c is None:
            return self.base.model_flops(action, schedule)
        return c.flops if c.model_flops is None else c.model_flops


def with_rules(base: Any, rules: Mapping[str, CostRule]) -> Any:
    """``base`` with ``rules`` in front, or ``base`` itself when there are none."""
    return RuledCost(base, dict(rules)) if rules else base
