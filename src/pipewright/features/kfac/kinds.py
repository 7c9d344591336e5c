"""The K-FAC action kinds (pure Python) and their dependency rules.

Payloads name the layer: ``Action(s, KFAC_A, k, l)`` is curvature A of local layer l of stage s from
microbatch k. An inversion split into pieces carries a :class:`Piece` payload. Events are
``(kind, stage, microbatch, payload)`` so that every layer's task is its own event.

==========================  ===================================================================
action                      requires
==========================  ===================================================================
``KFAC_A(s, k, l)``         ``F(s, k)`` (the layer inputs of microbatch k exist)
``KFAC_B(s, k, l)``         ``I(s, k)`` (the output gradients exist; a full ``B`` produces ``I``)
``KFAC_REDUCE(s, (l, A))``  every ``KFAC_A(s, k, l)`` of the refresh (collective over dp); ``(l, B)``
                            every ``KFAC_B(s, k, l)``; a bare layer l: both (one reduction)
``KFAC_INV_A/B(s, l)``      ``KFAC_REDUCE(s, (l, A))`` / ``(l, B)``: A's inversion waits for A's
                            curvature and reduction only, as PipeFisher's ``inv_kron_A`` does; piece j
                            of a split inversion also piece j − 1
``KFAC_PRECOND(s)``         ``W(s, k)`` for every k (the stage's last weight gradient)
``KFAC_FILL(s, j)``         nothing: bubble j of the rank, filled at run time (see ``runtime.py``)
==========================  ===================================================================

A refresh may span several iterations; each iteration is its own :class:`~pipewright.ir.Schedule`
whose ``meta["kfac_prior"]`` holds the K-FAC events completed in earlier iterations of the refresh, so
requirements only name events of the same iteration; ``meta["kfac_carried"]`` names the curvature tasks
that use inputs or gradients saved in an earlier iteration (they wait for nothing).
"""

from __future__ import annotations

from typing import NamedTuple

from pipewright.ir import Action, F, I, KindRegistry, KindSpec, Schedule, W
from pipewright.kinds import Collective

KFAC_A = "KFAC_A"
KFAC_B = "KFAC_B"
KFAC_REDUCE = "KFAC_REDUCE"
KFAC_INV_A = "KFAC_INV_A"
KFAC_INV_B = "KFAC_INV_B"
KFAC_PRECOND = "KFAC_PRECOND"
KFAC_FILL = "KFAC_FILL"

CURVATURE = (KFAC_A, KFAC_B)
KFAC_KINDS_ALL = (KFAC_A, KFAC_B, KFAC_REDUCE, KFAC_INV_A, KFAC_INV_B, KFAC_PRECOND, KFAC_FILL)


class Piece(NamedTuple):
    """Piece ``index`` of layer ``layer``'s inversion split into ``panels`` Cholesky panels and then
    ``blocks`` column blocks of the inverse (0: one piece, the inverse from the factor); see
    :func:`pipewright.features.kfac.cost.inversion_piece_weights`. Beyond the paper."""

    layer: int
    index: int
    panels: int
    blocks: int

    @property
    def count(self) -> int:
        return self.panels + max(self.blocks, 1)

    def __str__(self) -> str:
        return f"{self.layer}#{self.index}/{self.panels}+{self.blocks}"


class Factor(NamedTuple):
    """The payload of a per-factor reduction: Kronecker factor ``factor`` ("A" or "B") of ``layer``."""

    layer: int
    factor: str

    def __str__(self) -> str:
        return f"{self.layer}{self.factor}"


def layer_of(payload: object) -> int:
    return payload.layer if isinstance(payload, (Piece, Factor)) else int(payload)  # type: ignore[arg-type]


def factor_of(kind: str) -> str:
    """ "A" for curvature or inversion of A, "B" for those of B."""
    return "A" if kind in (KFAC_A, KFAC_INV_A) else "B"


def _event(a: Action) -> tuple:
    return (a.kind, a.stage, a.microbatch, a.payload)


def _produces(a: Action, schedule: Schedule) -> tuple:
    return (_event(a),)


def _prior(schedule: Schedule) -> frozenset:
    return schedule.meta.get("kfac_prior", frozenset())


def _carried(a: Action, schedule: Schedule) -> bool:
    """Curvature from tensors saved in an earlier iteration (listed in ``meta["kfac_carried"]``)."""
    return _event(a) in schedule.meta.get("kfac_carried", frozenset())


def _curv_a_requires(a: Action, schedule: Schedule) -> tuple:
    return () if _carried(a, schedule) else ((F, a.stage, a.microbatch, None),)


def _curv_b_requires(a: Action, schedule: Schedule) -> tuple:
    return () if _carried(a, schedule) else ((I, a.stage, a.microbatch, None),)


def _reduce_requires(a: Action, schedule: Schedule) -> tuple:
    prior = _prior(schedule)
    layer = layer_of(a.payload)
    kinds = CURVATURE
    if isinstance(a.payload, Factor):
        kinds = tuple(k for k in CURVATURE if factor_of(k) == a.payload.factor)
    evs = [(kind, a.stage, k, layer) for k in range(schedule.num_microbatches) for kind in kinds]
    return tuple(e for e in evs if e not in prior)


def _inv_requires(a: Action, schedule: Schedule) -> tuple:
    p = a.payload
    if isinstance(p, Piece) and p.index > 0:
        ev = (a.kind, a.stage, None, p._replace(index=p.index - 1))
    else:
        ev = (KFAC_REDUCE, a.stage, None, Factor(layer_of(p), factor_of(a.kind)))
    return () if ev in _prior(schedule) else (ev,)


def _no_requirements(a: Action, schedule: Schedule) -> tuple:
    return ()


def _precond_requires(a: Action, schedule: Schedule) -> tuple:
    return tuple((W, a.stage, k, None) for k in range(schedule.num_microbatches))


KFAC_SPECS = (
    KindSpec(KFAC_A, _curv_a_requires, _produces, per_microbatch=True, description="K-FAC curvature A"),
    KindSpec(KFAC_B, _curv_b_requires, _produces, per_microbatch=True, description="K-FAC curvature B"),
    KindSpec(
        KFAC_REDUCE,
        _reduce_requires,
        _produces,
        compute=False,
        collective=Collective("all_reduce", group="dp"),
        per_microbatch=False,
        description="K-FAC factor all-reduce over data-parallel replicas",
    ),
    KindSpec(KFAC_INV_A, _inv_requires, _produces, per_microbatch=False, description="K-FAC inversion of A"),
    KindSpec(KFAC_INV_B, _inv_requires, _produces, per_microbatch=False, description="K-FAC inversion of B"),
    KindSpec(
        KFAC_FILL,
        _no_requirements,
        _produces,
        per_microbatch=False,
        description="a predicted bubble: the runtime runs pending K-FAC tasks that fit its length",
    ),
    KindSpec(
        KFAC_PRECOND,
        _precond_requires,
        _produces,
        per_microbatch=False,
        description="K-FAC preconditioning of a stage's gradients",
    ),
)


def with_kfac_kinds(kinds: KindRegistry) -> KindRegistry:
    """``kinds`` plus the K-FAC kinds (unchanged if they are there already)."""
    if KFAC_A in kinds:
        return kinds
    return kinds.with_kinds(*KFAC_SPECS)
