"""Action kinds of vocabulary parallelism and their dependency rules (pure Python).

Every vocabulary action of rank r names the rank's *home* stage, the lowest stage the rank holds (r
itself under the loop and the V placements), so ``(kind, home(r), k)`` identifies it. Per microbatch k:

==============  =========================================  =====================================
kind            what                                       requires
==============  =========================================  =====================================
``VEF``         input embedding: lookup of the rank's rows —
``VEC``         SUM of the lookups to stage 0 (collective)  ``VEF(k)`` on every rank
``VBX``         broadcast of X from the last stage          ``F(last, k)``
``VS``          pass S                                     ``VBX(k)`` on the rank
``VC0``         barrier after S (statistics merge; alg2    ``VS(k)`` on every rank
                also the SUM of the rescaled ∇X)
``VT``          pass T                                     ``VC0(k)`` on the rank
``VC1``         SUM of ∇X after T (alg1 only)              ``VT(k)`` on every rank
``VEBC``        broadcast of ∇embedding from stage 0       ``I(0, k)``
``VEB``         input embedding backward (rank's rows)     ``VEBC(k)`` on the rank
==============  =========================================  =====================================

and the core kinds gain two requirements: ``F(0, k)`` needs ``VEC(k)`` of stage 0's rank; the last
stage's backward ``B``/``I`` needs ∇X — ``VC1(k)`` (alg1) or ``VC0(k)`` (alg2) of the last stage's rank.
A collective's requirement on *every* rank is the rendezvous: it starts when its last participant
arrives. ``VS`` adds one vocabulary-microbatch of memory (its softmax and X), ``VT`` frees it; both are
counted apart from the transformer activations (``KindSpec.memory`` stays 0 so ``peak_in_flight``
keeps counting transformer microbatches).
"""

from __future__ import annotations

from pipewright.deps import CORE_KINDS
from pipewright.ir import Action, B, Event, F, I, KindRegistry, KindSpec, Schedule

VEF, VEC, VBX, VS, VC0, VT, VC1, VEBC, VEB = "VEF", "VEC", "VBX", "VS", "VC0", "VT", "VC1", "VEBC", "VEB"
COMPUTE_KINDS = (VEF, VS, VT, VEB)
COLLECTIVE_KINDS = (VEC, VBX, VC0, VC1, VEBC)
ALL_KINDS = COMPUTE_KINDS + COLLECTIVE_KINDS


def home(schedule: Schedule, rank: int) -> int:
    """The stage that names rank ``rank``'s vocabulary actions: the lowest stage it holds."""
    return schedule.placement.index(rank)  # stages are numbered in order: the first listed is lowest


def _homes(schedule: Schedule) -> list[int]:
    return [schedule.placement.index(r) for r in range(schedule.num_ranks)]


def _on_every_rank(kind: str):
    def rule(action: Action, schedule: Schedule) -> tuple[Event, ...]:
        return tuple((kind, h, action.microbatch) for h in _homes(schedule))

    return rule


def _on_own_rank(kind: str):
    def rule(action: Action, schedule: Schedule) -> tuple[Event, ...]:
        return ((kind, action.stage, action.microbatch),)

    return rule


def _nothing(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ()


def _last_forward(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((F, schedule.num_stages - 1, action.microbatch),)


def _first_input_grad(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ((I, 0, action.microbatch),)


def _spec(name: str, requires, *, compute: bool, description: str) -> KindSpec:
    return KindSpec(
        name,
        requires,
        compute=compute,
        comm=None if compute else "collective",
        per_microbatch=True,
        description=description,
    )


def vocab_kinds() -> tuple[KindSpec, ...]:
    """The nine vocabulary kinds (their rules do not depend on the algorithm)."""
    return (
        _spec(VEF, _nothing, compute=True, description="vocabulary-parallel embedding lookup"),
        _spec(VEC, _on_every_rank(VEF), compute=False, description="embedding SUM to stage 0"),
        _spec(VBX, _last_forward, compute=False, description="broadcast of the last stage's output"),
        _spec(VS, _on_own_rank(VBX), compute=True, description="output pass S"),
        _spec(VC0, _on_every_rank(VS), compute=False, description="barrier after S"),
        _spec(VT, _on_own_rank(VC0), compute=True, description="output pass T"),
        _spec(VC1, _on_every_rank(VT), compute=False, description="input-gradient SUM after T"),
        _spec(VEBC, _first_input_grad, compute=False, description="broadcast of the embedding gradient"),
        _spec(VEB, _on_own_rank(VEBC), compute=True, description="embedding backward"),
    )


def _with_extra(spec: KindSpec, extra) -> KindSpec:
    base = spec.requires

    def requires(action: Action, schedule: Schedule) -> tuple[Event, ...]:
        return base(action, schedule) + extra(action, schedule)

    return KindSpec(
        spec.name,
        requires,
        spec.produces,
        spec.compute,
        spec.comm,
        spec.memory,
        spec.torch,
        spec.per_microbatch,
        spec.description,
    )


def registry(algorithm: str, base: KindRegistry = CORE_KINDS) -> KindRegistry:
    """``base`` plus the vocabulary kinds, with F of stage 0 and the last stage's backward tied to them."""
    grad_kind = VC1 if algorithm in ("alg1", "naive") else VC0

    def forward_extra(action: Action, schedule: Schedule) -> tuple[Event, ...]:
        if action.stage != 0 or not _uses_vocab(schedule):
            return ()
        return ((VEC, home(schedule, schedule.rank_of(0)), action.microbatch),)

    def backward_extra(action: Action, schedule: Schedule) -> tuple[Event, ...]:
        last = schedule.num_stages - 1
        if action.stage != last or not _uses_vocab(schedule):
            return ()
        return ((grad_kind, home(schedule, schedule.rank_of(last)), action.microbatch),)

    specs = []
    for name, spec in base.items():
        if name == F:
            spec = _with_extra(spec, forward_extra)
        elif name in (B, I):
            spec = _with_extra(spec, backward_extra)
        specs.append(spec)
    return KindRegistry([*specs, *vocab_kinds()])


def _uses_vocab(schedule: Schedule) -> bool:
    return bool(schedule.meta.get("vocab_parallel"))
