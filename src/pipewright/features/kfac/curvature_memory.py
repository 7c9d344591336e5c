"""K-FAC's memory on a rank, as the runtime (:mod:`.kfac`, :mod:`.runtime`) holds it, and the bubble
plan that decides when it is freed. Pure Python.

What the runtime keeps, per covered linear layer (d_a = d_in + 1 with a bias, else d_in; e the bytes
of the compute dtype; n = b·s tokens a microbatch):

- **state, all step** (a finished refresh leaves it): the factors A (d_a²) and B (d_out²) and their
  inverses, fp32: 8·(d_a² + d_out²) bytes;
- **the refresh's sums**: A's sum (4·d_a²) from the layer's first curvature-A task of the recording
  iteration until its reduction in a later one, B's (4·d_out²) likewise;
- **per microbatch k of the recording iteration**: the layer's input (n·d_in·e; layers reading one
  tensor — Llama's q, k, v — share it) from F(k) and its output gradient (n·d_out·e) from the backward,
  each until the bubble task that folds it into the sum. An input autograd keeps for the layer's own
  backward (every covered input of the Llama and GPT blocks) costs nothing more until that backward
  frees it; one it does not keep would be held from F(k);
- **the preconditioned gradient** V = B⁻¹[∇W, ∇b]A⁻¹ (4·d_out·d_a) from the stage's ``KFAC_PRECOND``
  to the optimizer step.

Which bubble runs which curvature task (:func:`plan_fills`): PipeFisher's rule as the runtime applies
it — in each ``KFAC_FILL``, in priority order (curvature A by layer then microbatch, then B likewise),
the first pending task whose 1.05 × duration fits what is left of the bubble, until none fits — with
predicted durations (a task's FLOPs at half the fp32 peak, over the predicted F of the rank, the unit
of the bubbles' lengths) in place of measured ones, so the placement is the same on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median

from pipewright.features.kfac.cost import LinearShape
from pipewright.features.kfac.kinds import KFAC_FILL, KFAC_PRECOND
from pipewright.features.kfac.tasks import FIT
from pipewright.ir import Action, B, F, I, Schedule, W

#: a planned curvature task: ("A" or "B", the layer's index on the rank, microbatch)
Task = tuple[str, int, int]


@dataclass(frozen=True)
class CoveredLinear(LinearShape):
    """One linear layer K-FAC covers, as one rank holds it (its shard under tensor parallelism).
    ``reads``: the name of the tensor it reads within its block (layers reading one share it);
    ``kept``: whether autograd keeps that tensor for the layer's own backward anyway."""

    reads: str = ""
    kept: bool = True


def _llama(spec, tp: int) -> tuple[CoveredLinear, ...]:
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_heads * spec.head_dim
    return (
        CoveredLinear(h, h // tp, False, "attn_norm"),
        CoveredLinear(h, kv // tp, False, "attn_norm"),
        CoveredLinear(h, kv // tp, False, "attn_norm"),
        CoveredLinear(h // tp, h, False, "attention"),
        CoveredLinear(h, f // tp, False, "mlp_norm"),
        CoveredLinear(h, f // tp, False, "mlp_norm"),
        CoveredLinear(f // tp, h, False, "swiglu"),
    )


def _gpt(spec, tp: int) -> tuple[CoveredLinear, ...]:
    h, f = spec.hidden, spec.ffn_hidden
    return (
        CoveredLinear(h, 3 * h // tp, True, "ln_attn"),
        CoveredLinear(h // tp, h, True, "attention"),
        CoveredLinear(h, f // tp, True, "ln_mlp"),
        CoveredLinear(f // tp, h, True, "gelu"),
    )


#: a model family → its block's covered linears in module order (what ``covered_layers`` lists);
#: mixtures of experts are not priced
BLOCKS: dict[str, Callable] = {"llama": _llama, "gpt": _gpt}


def block_linears(spec, tp: int = 1) -> tuple[CoveredLinear, ...] | None:
    """The covered linears of one of ``spec``'s blocks, or None where K-FAC's memory is not priced."""
    make = BLOCKS.get(spec.family)
    if make is None or spec.moe_experts:
        return None
    if tp > 1:  # row-parallel layers (input split) have no ones column in A, as the runtime's (.kfac)
        return tuple(
            CoveredLinear(x.d_in, x.d_out, x.bias and x.d_in == spec.hidden, x.reads, x.kept)
            for x in make(spec, tp)
        )
    return make(spec, tp)


@dataclass(frozen=True)
class RankLinears:
    """The covered linears of one rank, in the runtime's order (its stages in order, their blocks,
    each block's layers): ``layers[i]`` = (stage, block, linear)."""

    layers: tuple[tuple[int, int, CoveredLinear], ...]

    @classmethod
    def of(cls, blocks_of_stage: Mapping[int, int], block: Sequence[CoveredLinear]) -> RankLinears:
        return cls(
            tuple(
                (s, j, lin)
                for s in sorted(blocks_of_stage)
                for j in range(blocks_of_stage[s])
                for lin in block
            )
        )

    def of_stage(self, stage: int) -> list[int]:
        return [i for i, (s, _, _) in enumerate(self.layers) if s == stage]

    def state_bytes(self) -> float:
        """Factors and inverses, fp32: 8·(d_a² + d_out²) a layer."""
        return sum(8.0 * (x.dim_a**2 + x.d_out**2) for _, _, x in self.layers)

    def step_bytes(self) -> float:
        """What the optimizer step adds while it KL-clips (``KFAC.apply``): each layer with a bias
        gets [∇W, ∇b] as a new fp32 matrix (4·d_out·d_a), all kept until the clip's scale is known
        (without a bias the fp32 gradient itself is used); and ⟨V, ∇⟩ is summed in float64, a layer
        at a time: V and ∇ in float64 and their product, 24·d_out·d_a for the largest layer."""
        copies = sum(4.0 * x.d_out * x.dim_a for _, _, x in self.layers if x.bias)
        return copies + max((24.0 * x.d_out * x.dim_a for _, _, x in self.layers), default=0.0)


def curvature_estimates(linears: RankLinears, tokens: int, rate: float, unit: float) -> dict[tuple, float]:
    """Curvature A and B of each layer for one microbatch (2·n·d_a² and 2·n·d_out² FLOPs at ``rate``),
    in units of ``unit`` seconds (the rank's F), keyed as the runtime's worker keys its estimates."""
    out = {}
    for i, (_, _, x) in enumerate(linears.layers):
        out[("A", i)] = 2.0 * tokens * x.dim_a**2 / rate / unit
        out[("B", i)] = 2.0 * tokens * x.d_out**2 / rate / unit
    return out


@dataclass(frozen=True)
class FillPlan:
    """One rank's planned bubbles (:func:`plan_fills`) and how many covered layers the plan counts
    (the runtime checks it holds as many)."""

    fills: Mapping[tuple, tuple[Task, ...]]
    layers: int


def first_fitting(tasks: Sequence[Task], estimate: Callable[[Task], float], left: float) -> Task | None:
    """The first of ``tasks`` (priority order) whose 1.05 × estimate fits ``left``."""
    return next((t for t in tasks if FIT * estimate(t) <= left), None)


def plan_fills(
    row: Sequence[Action],
    linears: RankLinears,
    budgets: Mapping[tuple, float],
    estimates: Mapping[tuple, float],
) -> dict[tuple, tuple[Task, ...]]:
    """The curvature tasks each ``KFAC_FILL`` of the recording iteration runs (see the module), keyed
    by (stage, bubble index): ``row`` is the rank's slotted actions, ``budgets`` the bubbles' lengths
    and ``estimates`` the tasks' durations, both in F units."""
    pending: set[Task] = set()
    out: dict[tuple, tuple[Task, ...]] = {}
    for a in row:
        if a.kind == F:
            pending |= {("A", i, a.microbatch) for i in linears.of_stage(a.stage)}
        elif a.kind in (B, I):
            pending |= {("B", i, a.microbatch) for i in linears.of_stage(a.stage)}
        elif a.kind == KFAC_FILL:
            left, ran = budgets[(a.stage, a.payload)], []
            order = sorted(pending, key=lambda t: (t[0], t[1], t[2]))
            while left > 0 and (t := first_fitting(order, lambda t: estimates[t[:2]], left)) is not None:
                order.remove(t)
                pending.discard(t)
                ran.append(t)
                left -= estimates[t[:2]]
            out[(a.stage, a.payload)] = tuple(ran)
    return out


def memory_deltas(
    row: Sequence[Action],
    linears: RankLinears,
    fills: Mapping[tuple, tuple[Task, ...]],
    tokens: int,
    element: int,
) -> list[float]:
    """The bytes K-FAC adds (+) or frees (−) at each action of ``row`` in the recording iteration,
    on top of the base model's activations (see the module); their sum is what it still holds when
    the iteration's last action ends (inputs and gradients of tasks left for later bubbles, the
    preconditioned gradients)."""
    held: dict[tuple, int] = {}  # (stage, block, tensor read, microbatch) → layers still to read it
    autograd: set[tuple] = set()  # inputs autograd keeps until the microbatch's backward
    summed: set[tuple[str, int]] = set()
    out = []
    for a in row:
        d = 0.0
        if a.kind == F:
            for i in linears.of_stage(a.stage):
                s, j, x = linears.layers[i]
                key = (s, j, x.reads, a.microbatch)
                if key not in held:
                    d += 0.0 if x.kept else tokens * x.d_in * element
                    if x.kept:
                        autograd.add(key)
                held[key] = held.get(key, 0) + 1
        elif a.kind in (B, I, W):
            for i in linears.of_stage(a.stage):
                s, j, x = linears.layers[i]
                key = (s, j, x.reads, a.microbatch)
                if a.kind != W:
                    d += tokens * x.d_out * element  # the output gradient
                frees_inputs = a.kind == W or (a.kind == B and not _split(row, a.stage))
                if frees_inputs and key in autograd:
                    autograd.discard(key)
                    if held.get(key):  # K-FAC still reads it: what the base model frees stays
                        d += tokens * x.d_in * element
        elif a.kind == KFAC_FILL:
            for which, i, k in fills.get((a.stage, a.payload), ()):
                s, j, x = linears.layers[i]
                if (which, i) not in summed:
                    summed.add((which, i))
                    d += 4.0 * (x.dim_a if which == "A" else x.d_out) ** 2
                if which == "B":
                    d -= tokens * x.d_out * element
                    continue
                key = (s, j, x.reads, k)
                held[key] -= 1
                if not held[key] and key not in autograd:
                    d -= tokens * x.d_in * element
        elif a.kind == KFAC_PRECOND:  # V of every layer of the stage, kept until the step
            mine = (linears.layers[i][2] for i in linears.of_stage(a.stage))
            d += sum(4.0 * x.d_out * x.dim_a for x in mine)
        out.append(d)
    return out


def task_flops(
    row: Sequence[Action], linears: RankLinears, fills: Mapping[tuple, tuple[Task, ...]], tokens: int
) -> dict[str, float]:
    """FLOPs of the K-FAC work in ``row`` by action kind: each planned curvature task's 2·n·d²
    (d = d_a for A, d_out for B) in its ``KFAC_FILL``, and each ``KFAC_PRECOND``'s B⁻¹·G·A⁻¹,
    2·d_out·d_a·(d_out + d_a) a layer of its stage."""
    out = {KFAC_FILL: 0.0, KFAC_PRECOND: 0.0}
    for a in row:
        if a.kind == KFAC_FILL:
            for which, i, _ in fills.get((a.stage, a.payload), ()):
                x = linears.layers[i][2]
                out[KFAC_FILL] += 2.0 * tokens * (x.dim_a if which == "A" else x.d_out) ** 2
        elif a.kind == KFAC_PRECOND:
            for i in linears.of_stage(a.stage):
                x = linears.layers[i][2]
                out[KFAC_PRECOND] += 2.0 * x.d_out * x.dim_a * (x.d_out + x.dim_a)
    return out


def _split(row: Sequence[Action], stage: int) -> bool:
    return any(a.kind == W and a.stage == stage for a in row)


def rank_unit(cost, schedule: Schedule, rank: int) -> float:
    """The median predicted F of ``rank`` (seconds): the unit of the bubbles' lengths."""
    return median(float(cost.compute_time(a, schedule)) for a in schedule.actions[rank] if a.kind == F)
