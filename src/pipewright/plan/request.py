"""``pipewright simulate``'s request: the parsed options (a plan file's values applied) as one value,
built once and handed to the features' simulate hooks. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlanOverrides:
    """What a plan file (``--plan``) sets for ``pipewright simulate``: option values by name (degrees,
    schedule, batch, model dimensions) and the plan's own data: ``layout`` (layers per model chunk),
    ``recompute`` (per stage) and ``devices`` (the device of each rank, in the mesh's default order)."""

    plan: Any
    values: Mapping[str, Any] = field(default_factory=dict)
    layout: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SimulateRequest:
    """One ``pipewright simulate`` invocation. ``gpu``, ``microbatch_size``, ``png``, ``json``: the
    core options the features' hooks read; ``options``: every option by name (the features' own flags
    too: :meth:`option`); ``plan``: the plan file's overrides, or None."""

    gpu: str | None
    microbatch_size: int | None
    png: str | None
    json: bool
    options: Mapping[str, Any]
    plan: PlanOverrides | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any], plan: PlanOverrides | None = None) -> SimulateRequest:
        """The request of parsed ``options`` (an argparse Namespace's ``vars``)."""
        return cls(
            gpu=options.get("gpu"),
            microbatch_size=options.get("microbatch_size"),
            png=options.get("png"),
            json=bool(options.get("json")),
            options=dict(options),
            plan=plan,
        )

    def option(self, name: str, default: Any = None) -> Any:
        """The value of option ``name`` (a feature's flag, by its argparse destination)."""
        return self.options.get(name, default)
