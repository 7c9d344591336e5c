"""Costs of the K-FAC tasks (pure Python): from FLOPs, or from PipeFisher's per-block profiles.

FLOPs per linear layer with d = d_in + 1 (ones column; d_in without a bias), e = d_out, n tokens:
curvature A 2·n·d², curvature B 2·n·e², inversion of an m×m factor m³ (Cholesky m³/3 + the inverse
from the factor 2m³/3), preconditioning 2·e·d·(e + d). A profile gives the times of a whole block
(time_kron: both factors of every layer for one microbatch; time_inv; time_prec); they are split over
the block's layers in proportion to those FLOPs, so the layers of a block add up to the profile.

:class:`KFACCost` wraps any :class:`~pipewright.cost.base.CostModel` and answers for the K-FAC kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.cost.base import CostModel
from pipewright.errors import ConfigError
from pipewright.features.kfac.kinds import (
    KFAC_A,
    KFAC_B,
    KFAC_INV_A,
    KFAC_INV_B,
    KFAC_KINDS_ALL,
    KFAC_PRECOND,
    KFAC_REDUCE,
    Factor,
    Piece,
    layer_of,
)
from pipewright.ir import Action, Schedule


@dataclass(frozen=True)
class LinearShape:
    """One linear layer K-FAC covers."""

    d_in: int
    d_out: int
    bias: bool = True

    @property
    def dim_a(self) -> int:
        return self.d_in + int(self.bias)

    @property
    def dim_b(self) -> int:
        return self.d_out


def block_layers(hidden: int, ffn_hidden: int) -> tuple[LinearShape, ...]:
    """The covered linears of one transformer block: fused QKV, attention output, MLP in, MLP out."""
    return (
        LinearShape(hidden, 3 * hidden),
        LinearShape(hidden, hidden),
        LinearShape(hidden, ffn_hidden),
        LinearShape(ffn_hidden, hidden),
    )


def curvature_flops(shape: LinearShape, tokens: int, which: str) -> float:
    m = shape.dim_a if which == "A" else shape.dim_b
    return 2.0 * tokens * m * m


def inversion_flops(m: int) -> float:
    return float(m) ** 3


def precondition_flops(shape: LinearShape) -> float:
    d, e = shape.dim_a, shape.dim_b
    return 2.0 * e * d * (e + d)


def inversion_piece_weights(m: int, panels: int, blocks: int) -> tuple[float, ...]:
    """Costs of an m×m Cholesky inversion split into pieces, relative to the unsplit inversion (m³).

    ``panels`` pieces of a right-looking blocked Cholesky in equal column panels (panel j of width
    b = m/panels costs b·r_j² with r_j = m − j·b rows left, trailing update included; m³/3 together),
    then either one piece forming the inverse from the factor (``blocks`` = 0: 2m³/3, no extra work),
    or ``blocks`` pieces that each solve L·Lᵀ·X_J = E_J for m/blocks columns of the inverse (2m³
    together: the split then costs 7/3 of the unsplit work, the price of pieces that small)."""
    b = m / panels
    m3 = float(m) ** 3
    work = [b * (m - j * b) ** 2 for j in range(panels)]
    scale = (m3 / 3) / sum(work)
    head = tuple(w * scale / m3 for w in work)
    if blocks == 0:
        return (*head, 2 / 3)
    return head + (2 * m * m * (m / blocks) / m3,) * blocks


def split_plan(m: int, whole: float, limit: float, margin: float = 1.05) -> tuple[int, int] | None:
    """The cheapest split of an inversion lasting ``whole`` whose every piece × ``margin`` fits in
    ``limit``: (panels, blocks), fewest extra FLOPs first, then fewest pieces; None if none does."""
    for blocks_options in ((0,), tuple(range(1, 257))):
        for blocks in blocks_options:
            for panels in range(1, 257):
                if max(inversion_piece_weights(m, panels, blocks)) * whole * margin <= limit:
                    return panels, blocks
                if blocks == 0 and panels > 1 and 2 / 3 * whole * margin > limit:
                    break  # the inverse-from-factor piece alone is too long
    return None


@dataclass(frozen=True)
class TaskTimes:
    """Seconds of every K-FAC task of every covered layer of every stage.

    ``curv[s][l] = (A, B)`` for one microbatch, ``inv[s][l] = (A, B)`` for a whole inversion,
    ``prec[s]`` for the stage, ``factor_bytes[s][l]`` the fp32 bytes of the layer's two factors."""

    shapes: tuple[tuple[LinearShape, ...], ...]
    curv: tuple[tuple[tuple[float, float], ...], ...]
    inv: tuple[tuple[tuple[float, float], ...], ...]
    prec: tuple[float, ...]

    def layers(self, stage: int) -> int:
        return len(self.shapes[stage])

    def factor_bytes(self, stage: int, layer: int, factor: str | None = None) -> float:
        """fp32 bytes of the layer's factor ``factor`` ("A" or "B"; None: both)."""
        sh = self.shapes[stage][layer]
        return 4.0 * ((sh.dim_a**2 if factor != "B" else 0) + (sh.dim_b**2 if factor != "A" else 0))

    def inversion_piece(self, stage: int, kind: str, payload: object) -> float:
        layer = layer_of(payload)
        whole = self.inv[stage][layer][0 if kind == KFAC_INV_A else 1]
        if not isinstance(payload, Piece):
            return whole
        sh = self.shapes[stage][layer]
        m = sh.dim_a if kind == KFAC_INV_A else sh.dim_b
        return whole * inversion_piece_weights(m, payload.panels, payload.blocks)[payload.index]

    def refresh_work(self, stage: int, microbatches: int) -> float:
        """D·T_kron + T_inv of one stage: curvature of every microbatch plus every inversion."""
        curv = sum(a + b for a, b in self.curv[stage]) * microbatches
        return curv + sum(a + b for a, b in self.inv[stage])

    @classmethod
    def from_flops(
        cls, stage_shapes: Sequence[Sequence[LinearShape]], tokens: int, flops_per_s: float
    ) -> TaskTimes:
        """Times = FLOPs / ``flops_per_s`` (the rate the device reaches on these matmuls)."""
        if flops_per_s <= 0:
            raise ConfigError("K-FAC task costs need a positive FLOP rate")
        shapes = tuple(tuple(s) for s in stage_shapes)
        r = flops_per_s
        return cls(
            shapes,
            tuple(
                tuple((curvature_flops(x, tokens, "A") / r, curvature_flops(x, tokens, "B") / r) for x in st)
                for st in shapes
            ),
            tuple(
                tuple((inversion_flops(x.dim_a) / r, inversion_flops(x.dim_b) / r) for x in st)
                for st in shapes
            ),
            tuple(sum(precondition_flops(x) for x in st) / r for st in shapes),
        )

    @classmethod
    def from_block_profile(
        cls,
        blocks_per_stage: Sequence[int],
        block: Sequence[LinearShape],
        time_kron: float,
        time_inv: float,
        time_prec: float,
    ) -> TaskTimes:
        """Split a profiled block's (time_kron, time_inv, time_prec) over its layers by FLOPs."""
        block = tuple(block)
        curv = [(curvature_flops(x, 1, "A"), curvature_flops(x, 1, "B")) for x in block]
        ctot = sum(a + b for a, b in curv)
        inv = [(inversion_flops(x.dim_a), inversion_flops(x.dim_b)) for x in block]
        itot = sum(a + b for a, b in inv)
        curv_t = tuple((a / ctot * time_kron, b / ctot * time_kron) for a, b in curv)
        inv_t = tuple((a / itot * time_inv, b / itot * time_inv) for a, b in inv)
        return cls(
            tuple(block * n for n in blocks_per_stage),
            tuple(curv_t * n for n in blocks_per_stage),
            tuple(inv_t * n for n in blocks_per_stage),
            tuple(time_prec * n for n in blocks_per_stage),
        )


def pipefisher_task_times(model: str, gpu: str, bs: int, stages: int, layers: int | None = None) -> TaskTimes:
    """Task times from the packaged PipeFisher profile (BERT blocks: hidden 768/1024, FFN 4×)."""
    from pipewright.cost.profiled import PIPEFISHER_LAYERS, ProfiledCost

    prof = ProfiledCost.from_pipefisher(model, gpu, bs, layers=layers)
    n = layers if layers is not None else PIPEFISHER_LAYERS.get(model, stages)
    if n % stages:
        raise ConfigError(f"{n} blocks do not split evenly over {stages} stages; pass layers= a multiple")
    hidden = {"bert-base": 768, "bert-large": 1024, "opt-125m": 768, "opt-350m": 1024}.get(model, 1024)
    return TaskTimes.from_block_profile(
        [n // stages] * stages,
        block_layers(hidden, 4 * hidden),
        prof.time("layer", "KFAC_KRON"),
        prof.time("layer", "KFAC_INV"),
        prof.time("layer", "KFAC_PREC"),
    )


@dataclass(frozen=True)
class KFACCost:
    """A :class:`CostModel`: ``base`` for every kind, ``times`` for the K-FAC kinds."""

    base: CostModel
    times: TaskTimes

    def _kfac_time(self, a: Action) -> float:
        s = a.stage
        if a.kind in (KFAC_A, KFAC_B):
            return self.times.curv[s][layer_of(a.payload)][0 if a.kind == KFAC_A else 1]
        if a.kind in (KFAC_INV_A, KFAC_INV_B):
            return self.times.inversion_piece(s, a.kind, a.payload)
        if a.kind == KFAC_PRECOND:
            return self.times.prec[s]
        return 0.0

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        if action.kind in KFAC_KINDS_ALL:
            return self._kfac_time(action)
        return self.base.compute_time(action, schedule)

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind == KFAC_REDUCE:
            factor = action.payload.factor if isinstance(action.payload, Factor) else None
            return self.times.factor_bytes(action.stage, layer_of(action.payload), factor)
        return self.base.message_bytes(action, schedule)

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        return 0.0 if action.kind in KFAC_KINDS_ALL else self.base.activation_bytes(action, schedule)

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return self.base.static_bytes(rank, schedule)

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """The base model's recomputation transient for its actions; none for the K-FAC tasks."""
        transient = getattr(self.base, "transient_bytes", None)
        if transient is None or action.kind in KFAC_KINDS_ALL:
            return 0.0
        return transient(action, schedule)

    def flops(self, action: Action, schedule: Schedule) -> float:
        return 0.0 if action.kind in KFAC_KINDS_ALL else self.base.flops(action, schedule)

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        return 0.0 if action.kind in KFAC_KINDS_ALL else self.base.model_flops(action, schedule)
