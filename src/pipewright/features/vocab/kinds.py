"""Action kinds of vocabulary parallelism and their dependency rules (pure Python).

Every vocabulary action of rank r names the rank's *home* stage, the lowest stage the rank holds (r
itself under the loop and the V placements), so ``(kind, home(r), k)`` identifies it. Per microbatch k:

==============  =========================================  =====================================
kind            what                                       requires
==============  =========================================  =====================================
``VEF``         input embedding: lookup of the rank's rows —
``VEC``         SUM of the lookups to stage 0 (collective)  ``VEF(k)``
``VBX``         broadcast of X from the last stage          — (the last stage issues it after F(last, k))
``VSM``         naive only: S up to the max (local logits   ``VBX(k)`` on the rank
                and their row maxima)
``VCM``         naive only: MAX of the local maxima         ``VSM(k)``
``VS``          pass S (naive: its rest — exponentials,     ``VBX(k)`` on the rank (naive: ``VCM(k)``)
                Σexp and the target logit)
``VC0``         barrier after S (statistics merge; naive:  ``VS(k)``
                SUM of Σexp and target; alg2 also the SUM
                of the rescaled ∇X)
``VT``          pass T                                     ``VC0(k)`` on the rank
``VC1``         SUM of ∇X after T (alg1 only)              ``VT(k)``
``VEBC``        broadcast of ∇embedding from stage 0       — (stage 0 issues it after its I(0, k))
``VEB``         input embedding backward (rank's rows)     ``VEBC(k)`` on the rank
==============  =========================================  =====================================

X is ``VBX(k)`` on every rank but the broadcast's root, the last stage's rank, whose S needs only its own
``F(last, k)`` (the root does not wait for its own broadcast, as in the reference implementation).
The core kinds gain two requirements: ``F(0, k)`` needs ``VEC(k)`` of stage 0's rank; the last
stage's backward ``B``/``I`` needs ∇X — ``VC1(k)`` (alg1) or ``VC0(k)`` (alg2) of the last stage's rank.
The naive algorithm's first barrier is a rendezvous in the middle of S: S is two passes, ``VSM`` and
``VS``, around the MAX all-reduce ``VCM`` (the schedule's ``meta["vocab_parallel"] == "naive"`` makes
``VS`` wait for it); Algorithms 1 and 2 never use those two kinds. The collectives are
:class:`~pipewright.kinds.Collective` kinds over named groups spanning every pipeline rank (one
communicator per traffic kind: ``vocab_x``, ``vocab_max``, ``vocab_stats``, ``vocab_grad``,
``vocab_emb``, ``vocab_emb_back``), so the core treats each as a rendezvous that starts when the last
member issued it. The validator checks the issue order per member set, so the insertion pass issues all
vocabulary collectives in one global order on every rank. S (``VS``; naive: ``VSM``, which writes the
logits) adds one vocabulary-microbatch of memory (its softmax and X), ``VT`` frees it; both are counted
apart from the transformer activations (``KindSpec.memory`` stays 0 so ``peak_in_flight`` keeps
counting transformer microbatches).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipewright.deps import CORE_KINDS
from pipewright.ir import Action, B, Event, F, I, KindRegistry, KindSpec, Schedule
from pipewright.kinds import Collective

VEF, VEC, VBX, VS, VC0, VT, VC1, VEBC, VEB = "VEF", "VEC", "VBX", "VS", "VC0", "VT", "VC1", "VEBC", "VEB"
ALGORITHMS = ("naive", "alg1", "alg2")  # three, two, one barrier(s)
VSM, VCM = "VSM", "VCM"  # the naive algorithm's S up to the max, and the MAX all-reduce
COMPUTE_KINDS = (VEF, VSM, VS, VT, VEB)
COLLECTIVE_KINDS = (VEC, VBX, VCM, VC0, VC1, VEBC)
ALL_KINDS = COMPUTE_KINDS + COLLECTIVE_KINDS
#: collective kind → (operation, named group)
GROUPS = {
    VEC: ("reduce", "vocab_emb"),
    VBX: ("broadcast", "vocab_x"),
    VCM: ("all_reduce", "vocab_max"),
    VC0: ("all_gather", "vocab_stats"),
    VC1: ("all_reduce", "vocab_grad"),
    VEBC: ("broadcast", "vocab_emb_back"),
}


def home(schedule: Schedule, rank: int) -> int:
    """The stage that names rank ``rank``'s vocabulary actions: the lowest stage it holds."""
    return schedule.placement.index(rank)  # stages are numbered in order: the first listed is lowest


def all_ranks(action: Action, schedule: Schedule) -> tuple[int, ...]:
    """Members of every vocabulary collective: all pipeline ranks."""
    return tuple(range(schedule.num_ranks))


@dataclass(frozen=True)
class own:
    """Requires ``kind`` of the same stage and microbatch (picklable rule)."""

    kind: str

    def __call__(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        return ((self.kind, action.stage, action.microbatch, None),)


def x_input(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    """X of the action's microbatch: the broadcast ``VBX`` on every rank but the broadcast's root, the
    last stage's rank, whose X is its own forward's output — it does not wait for its own broadcast, as
    the reference implementation's root does not (``if not is_pipeline_last_stage(): handle.wait()``)."""
    last = schedule.num_stages - 1
    k = action.microbatch
    if schedule.rank_of(action.stage) == schedule.rank_of(last):
        return ((F, last, k, None),)
    return ((VBX, action.stage, k, None),)


def s_input(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    """Pass S requires X of its microbatch (:func:`x_input`); under the naive algorithm its second part
    requires the MAX all-reduce ``VCM`` instead (which requires the first part, which requires X)."""
    if schedule.meta.get("vocab_parallel") == "naive":
        return ((VCM, action.stage, action.microbatch, None),)
    return x_input(action, schedule)


def _nothing(action: Action, schedule: Schedule) -> tuple[Event, ...]:
    return ()


def _compute(name: str, requires, description: str) -> KindSpec:
    return KindSpec(name, requires, per_microbatch=True, description=description)


def _collective(name: str, requires, description: str) -> KindSpec:
    op, group = GROUPS[name]
    return KindSpec(
        name,
        requires,
        compute=False,
        collective=Collective(op, group, members=all_ranks),
        per_microbatch=True,
        description=description,
    )


def vocab_kinds() -> tuple[KindSpec, ...]:
    """The eleven vocabulary kinds (only S's rule depends on the algorithm, through the schedule's meta)."""
    return (
        _compute(VEF, _nothing, "vocabulary-parallel embedding lookup"),
        _collective(VEC, own(VEF), "embedding SUM to stage 0"),
        _collective(VBX, _nothing, "broadcast of the last stage's output"),
        _compute(VSM, x_input, "output pass S up to the max (naive algorithm)"),
        _collective(VCM, own(VSM), "MAX all-reduce inside S (naive algorithm)"),
        _compute(VS, s_input, "output pass S"),
        _collective(VC0, own(VS), "barrier after S"),
        _compute(VT, own(VC0), "output pass T"),
        _collective(VC1, own(VT), "input-gradient SUM after T"),
        _collective(VEBC, _nothing, "broadcast of the embedding gradient"),
        _compute(VEB, own(VEBC), "embedding backward"),
    )


@dataclass(frozen=True)
class with_vocab:
    """A core rule plus the vocabulary requirement: F(0, k) needs VEC(k) of stage 0's rank; the last
    stage's B/I needs ∇X, ``grad_kind`` (VC1 or VC0) of the last stage's rank. Only in schedules whose
    ``meta["vocab_parallel"]`` is set."""

    base: object
    grad_kind: str

    def __call__(self, action: Action, schedule: Schedule) -> tuple[Event, ...]:
        events = self.base(action, schedule)
        if not schedule.meta.get("vocab_parallel"):
            return events
        last = schedule.num_stages - 1
        k = action.microbatch
        if action.kind == F and action.stage == 0:
            return (*events, (VEC, home(schedule, schedule.rank_of(0)), k, None))
        if action.kind in (B, I) and action.stage == last:
            return (*events, (self.grad_kind, home(schedule, schedule.rank_of(last)), k, None))
        return events


def registry(algorithm: str, base: KindRegistry = CORE_KINDS) -> KindRegistry:
    """``base`` plus the vocabulary kinds, with F of stage 0 and the last stage's backward tied to them."""
    grad_kind = VC1 if algorithm in ("alg1", "naive") else VC0
    specs = []
    for name, spec in base.items():
        if name in (F, B, I) and not isinstance(spec.requires, with_vocab):
            spec = replace(spec, requires=with_vocab(spec.requires, grad_kind))
        if name not in ALL_KINDS:
            specs.append(spec)
    return KindRegistry([*specs, *vocab_kinds()])
