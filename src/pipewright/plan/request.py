"""``pipewright simulate``'s request: the run's RunSpec (a plan file's values applied) as one value,
built once and handed to the features' simulate hooks. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlanOverrides:
    """What a plan file (``--plan``) gives ``pipewright simulate`` beyond the spec's values: the plan
    itself, ``layout`` (layers per model chunk), ``recompute`` (per stage) and ``devices`` (the device
    of each rank, in the mesh's default order)."""

    plan: Any
    layout: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SimulateRequest:
    """One ``pipewright simulate`` invocation: ``spec``, the run (a
    :class:`~pipewright.runspec.RunSpec`; a feature's own settings are ``spec.features[name]``), and
    ``plan``, the plan file's data beyond it, or None."""

    spec: Any
    plan: PlanOverrides | None = None

    @property
    def gpu(self) -> str | None:
        return self.spec.cluster.gpu

    @property
    def microbatch_size(self) -> int | None:
        return self.spec.batch.microbatch_size

    @property
    def png(self) -> str | None:
        return self.spec.output.png

    @property
    def json(self) -> bool:
        return bool(self.spec.output.json)
