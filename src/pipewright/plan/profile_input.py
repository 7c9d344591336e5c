"""A measured cost table (``pipewright profile``) as the planner's model input.

The profile gives, per microbatch size, the seconds of F and B (or I and W) of one transformer layer,
of the embedding and of the output layer with its loss, the activation bytes each forward keeps, the
static bytes (``PARAMS``) of each and the stage-boundary message (``MESSAGE``) — measured at the
profile's tensor-parallel size on its device (:mod:`pipewright.cost.profiled`). Those are exactly the
planner's pieces (:class:`~pipewright.plan.costs.StageCost`), so the partition, the closed-form
estimate and the simulation of the finalists (:class:`~pipewright.cost.profiled.ProfiledCost`, with the
measured message time and, with ``--cores``, the profile's contention curve) run on measured numbers
instead of the analytical model. The search is then limited to what was measured: t = the profile's
tp, the profiled microbatch sizes, no recomputation (a profile measures one mode).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from pipewright.cost.profiled import MESSAGE, PARAMS, ProfiledCost, ProfileRow
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.plan.costs import StageCost

_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")


@dataclass(frozen=True, eq=False)
class ProfileInput:
    """Rows and ``# key=value`` header of a profile; ``layers`` overrides the header's layer count."""

    rows: tuple[ProfileRow, ...]
    meta: Mapping[str, str]
    layers: int | None = None

    def spec(self) -> ModelSpec:
        """The model the profile was taken of (its header's dimensions; one-line error if missing)."""
        missing = [d for d in _DIMS if d not in self.meta]
        if missing:
            raise ConfigError(
                f"the profile's header lacks {', '.join(missing)}; profile again with `pipewright profile`"
            )
        dims = {d: int(self.meta[d]) for d in _DIMS}
        if self.layers is not None:
            dims["layers"] = self.layers
        return ModelSpec(self.meta.get("model", "profiled"), **dims)

    @property
    def tp(self) -> int:
        return int(self.meta.get("tp", "1"))

    @property
    def microbatch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({r.microbatch_size for r in self.rows}))

    def cost(self, microbatch: int, layout=None) -> ProfiledCost:
        """The simulator's cost model at ``microbatch`` for ``layout`` (layers per chunk)."""
        return ProfiledCost(self.rows, microbatch, self.spec().layers, layout=layout, meta=dict(self.meta))

    @functools.cached_property
    def _one(self) -> dict[int, ProfiledCost]:
        return {b: self.cost(b) for b in self.microbatch_sizes}

    def stage_cost(self, microbatch: int) -> StageCost:
        """The planner's pieces at ``microbatch``: measured F and B seconds (and I and W, each B/2 where
        only B was measured), PARAMS and activation bytes of one layer, the embedding and the output
        layer."""
        pc = self._one[microbatch]
        t = {ty: (pc.time(ty, F), pc.time(ty, B)) for ty in ("layer", "embedding", "output")}
        split = {ty: (pc.time(ty, I), pc.time(ty, W)) for ty in t}
        static = {ty: pc.nbytes(ty, PARAMS) for ty in t}
        act = {ty: pc.nbytes(ty, F) for ty in t}
        return StageCost(
            *t["layer"], *t["embedding"], *t["output"],
            static["layer"], static["embedding"], static["output"],
            act["layer"], act["embedding"], act["output"],
            layer_iw=split["layer"], embed_iw=split["embedding"], head_iw=split["output"],
        )  # fmt: skip

    def boundary_bytes(self, microbatch: int) -> float:
        return self._one[microbatch].nbytes("layer", MESSAGE)

    def message_seconds(self, microbatch: int) -> float:
        """The measured one-way time of one boundary message (0 when not measured)."""
        return self._one[microbatch].time("layer", MESSAGE)

    def grad_bytes(self, microbatch: int, layers: int, first: bool, last: bool) -> float:
        """Bytes a stage all-reduces over data parallelism: its PARAMS bytes (as ProfiledCost's
        REDUCE_GRAD with its default one gradient byte per PARAMS byte)."""
        sc = self.stage_cost(microbatch)
        return sc.static(layers, first, last)
