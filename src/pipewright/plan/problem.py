"""What the planner searches: a candidate layout, the problem it plans for, and an evaluated candidate
(its partition, device assignment, closed-form estimate and, for finalists, its simulation)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipewright.cost.recompute import RECOMPUTE_CHOICES
from pipewright.cost.transformer import Efficiency
from pipewright.models.spec import ModelSpec
from pipewright.plan.cost_options import CostOptions
from pipewright.plan.profile_input import ProfileInput
from pipewright.topology import Topology

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-auto")

#: Megatron-LM's ``--make-vocab-size-divisible-by`` default: the vocabulary is padded to a multiple of
#: this times the tensor-parallel size.
VOCAB_MULTIPLE = 128

#: Lowered actions a candidate's simulation may have (``--max-actions``): about 6 per microbatch and
#: chunk (forward, backward, two sends, two receives).
MAX_ACTIONS = 2_000_000


def padded_vocab(vocab: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Megatron-LM's padded vocabulary (``_vocab_size_with_padding``): the next multiple of
    multiple·t, so the output layer and the embedding split evenly over t tensor-parallel ranks."""
    step = multiple * tp
    return -(-vocab // step) * step


def tp_splits(spec: ModelSpec, tp: int) -> bool:
    """Whether t tensor-parallel ranks split the model as ``pipewright train`` requires: heads, ffn
    (and Llama's kv heads), and — sequence parallelism being on whenever t > 1 — the sequence. The
    vocabulary is padded (:func:`padded_vocab`), so it always splits."""
    dims = [spec.heads, spec.ffn_hidden] + ([spec.seq_len] if tp > 1 else [])
    if spec.family == "llama":
        dims.append(spec.kv_heads)
    return all(x % tp == 0 for x in dims)


def lowered_actions(pp: int, microbatches: int, virtual: int) -> int:
    """About how many lowered actions one pipeline of the layout has (6 per microbatch and chunk)."""
    return 6 * pp * microbatches * virtual


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    style: str = "pp"
    cp: int = 1  # context-parallel size (ring attention)
    sharding: str = "none"  # optimizer state over the data-parallel group: none, zero1, fsdp
    ep: int = 1  # expert-parallel size, carved from dp (a mixture-of-experts model only)

    @property
    def block(self) -> int:
        """Devices of one (stage, replica): the tensor- and context-parallel ranks, tp fastest
        (Megatron's tp-cp-dp-pp order)."""
        return self.tp * self.cp

    def describe(self) -> str:
        v = f" v={self.virtual}" if self.virtual > 1 else ""
        sp = "+sp" if self.sequence_parallel else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        shard = f" {self.sharding}" if self.sharding != "none" else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"t={self.tp}{cp} p={self.pp} d={self.dp}{ep} b={self.microbatch} m={self.microbatches} "
            f"{self.schedule}{v} recompute={self.recompute}{sp}{shard} map={self.style}"
        )


@dataclass(frozen=True)
class Problem:
    """What to plan: a model on a topology with a global batch."""

    spec: ModelSpec
    topology: Topology
    global_batch: int
    dtype: str = "bf16"
    memory_limit: float | None = None  # bytes per device; None: each device's own memory
    efficiency: Efficiency | None = None  # None: each accelerator's own calibration defaults
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_tp: int = 8
    finalists: int = 6
    fixed: tuple[int | None, int | None, int | None] = (None, None, None)  # (tp, pp, dp) if given
    cores: float | None = None  # all processes share this many CPU cores (sim.sharing), e.g. --gpu cpu
    profile: ProfileInput | None = None  # measured costs, not the analytical model (plan/profile_input.py)
    max_actions: int = MAX_ACTIONS  # candidates whose simulation would be larger are skipped
    microbatch_group: int | None = None  # interleaved: Megatron's microbatch group N (plan/grouping.py)
    zb_refine_seconds: float | None = None  # zb-auto: seconds for the ILP refinement of its best order
    attention: str = "flash"  # flash or eager (the attention kernel priced)
    cp_choices: tuple[int, ...] = (1,)  # context-parallel sizes (plan/cost_options.py: cp_choices)
    ep: int | None = None  # expert-parallel size if fixed; None: searched (ep_choices)
    max_ep: int = 64  # the largest expert-parallel size searched
    sharding: tuple[str, ...] = ("none",)  # optimizer sharding choices (plan/cost_options.py)
    tp_comm_overlap: bool | str = False  # a cost.tp_overlap mode (True: te; the plan records it)
    attention_kernel: str | None = None
    moe_imbalance: float = 1.0
    calibration: str | None = None  # a `pipewright profile --calibration` file
    cost_fields: tuple[tuple[str, object], ...] = ()  # --grad-dtype, --kernels, --fsdp-grad-sync (sorted)
    framework: str | None = None  # --framework (recorded in the plan; its calibration is ``efficiency``)
    # --recompute-method/--recompute-num-layers (sorted pairs): how fully recomputed stages recompute in
    # the finalists' simulation (the estimate prices plain full recomputation)
    recompute_partial: tuple[tuple[str, object], ...] = ()
    _kinds: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)
    _efficiency: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def efficiency_for(self, kind: str | None = None) -> Efficiency:
        """The efficiency parameters priced on accelerator ``kind`` (default: the first device's): the
        given ones, else the accelerator's defaults — what ``pipewright simulate`` uses for it; the
        attention rate of ``attention_kernel`` on it where one is named, the GEMM rate for eager
        attention (its batched GEMMs)); computed once per kind."""
        name = kind or next(iter(self.device_kinds()))
        hit = self._efficiency.get(name)
        if hit is None:
            hit = self._efficiency[name] = self._efficiency_of(name)
        return hit

    def _efficiency_of(self, name: str) -> Efficiency:
        from pipewright.cost.attention_kernels import kernel_efficiency
        from pipewright.cost.efficiency import default_efficiency
        from pipewright.hardware import accelerator

        eff = self.efficiency if self.efficiency is not None else default_efficiency(accelerator(name))
        if self.calibration is not None:  # a `pipewright calibrate` file's constants replace the framework's
            from pipewright.cost.run_fit import apply_fitted
            from pipewright.plan.cost_options import _calibration

            eff = apply_fitted(eff, _calibration(self.calibration), name)
        if self.attention == "eager":
            return replace(eff, attention=eff.gemm)
        if self.attention_kernel is not None:
            rate = kernel_efficiency(name, self.attention_kernel)
            return eff if rate is None else replace(eff, attention=rate)
        return eff

    def device_kinds(self) -> dict[str, str]:
        """Each accelerator kind of the topology's devices → its first device (listed once)."""
        if not self._kinds:
            for d in self.topology.devices:
                self._kinds.setdefault(self.topology.nodes[d].accelerator, d)
        return self._kinds

    def options(self, c: Candidate) -> CostOptions:
        """The cost-model options of candidate ``c`` (:mod:`pipewright.plan.cost_options`)."""
        return CostOptions(
            self.attention,
            c.cp,
            c.sharding,
            self.tp_comm_overlap,
            self.calibration,
            self.attention_kernel,
            self.moe_imbalance,
            self.cost_fields,
        )

    def ep_choices(self, dp: int) -> tuple[int, ...]:
        """Expert-parallel sizes for data-parallel size ``dp``: the fixed ``ep`` where given (if it
        divides dp), else every ep ≤ ``max_ep`` dividing both dp and the routed experts, as the runtime
        carves ep from dp (Megatron-LM's expert parallelism); (1,) for a dense model."""
        spec = self.spec
        if not spec.is_moe:
            return (1,)
        if self.ep is not None:
            return (self.ep,) if dp % self.ep == 0 else ()
        return tuple(
            e for e in range(1, min(dp, self.max_ep) + 1) if dp % e == 0 and spec.moe_experts % e == 0
        )

    def spec_for(self, tp: int) -> ModelSpec:
        """The model as t tensor-parallel ranks run it: the vocabulary padded (:func:`padded_vocab`);
        a measured profile's model as it was measured."""
        if self.profile is not None:
            return self.spec
        return replace(self.spec, vocab=padded_vocab(self.spec.vocab, tp))


@dataclass
class Evaluated:
    """A candidate with its partition, device assignment, estimate and (for finalists) simulation."""

    candidate: Candidate
    chunk_layers: tuple[int, ...]
    devices: tuple[str, ...]  # global rank order
    estimate: float
    bottleneck: float
    peak_memory: float = 0.0  # estimated bytes on the fullest device
    simulated: float | None = None
    simulated_memory: float | None = None
    fits: bool = True
    label: str = "plan"
    why: str = ""
    schedule: object = None  # a generated Schedule (zb-auto's cost-aware order), else built by name
    zb_memory_limit: int | None = None
    recompute_per_stage: tuple[str, ...] | None = None  # one mode per chunk, when they differ

    @property
    def time(self) -> float:
        return self.simulated if self.simulated is not None else self.estimate


def why_slower(best: Evaluated, ev: Evaluated) -> str:
    """One line on how runner-up ``ev`` differs from ``best``: its slowdown and the choices that differ."""
    if not ev.fits:
        return "does not fit in memory in simulation"
    slower = ev.time / best.time - 1
    a, b = best.candidate, ev.candidate
    names = (
        ("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("ep", "ep"), ("microbatch", "microbatch"),
        ("schedule", "schedule"), ("v", "virtual"), ("recompute", "recompute"), ("mapping", "style"),
    )  # fmt: skip
    diffs = [
        f"{name} {getattr(b, attr)} vs {getattr(a, attr)}"
        for name, attr in names
        if getattr(a, attr) != getattr(b, attr)
    ]
    return f"{100 * slower:.1f}% slower ({', '.join(diffs) or 'same degrees, other partition'})"
