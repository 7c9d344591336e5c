"""Per-layer costs for the planner, read off the transformer cost model's chunk tables.

A stage holding n transformer layers (plus the embedding on the first stage, the output layer and loss
on the last) costs, per microbatch, n × (one layer) + embedding + head — every term of
:class:`~pipewright.cost.transformer.TransformerCost` is linear in the layer count. So the planner asks
the cost model once for a one-layer middle chunk, a layer-free first chunk (the embedding) and a
layer-free last chunk (the head) and prices any stage from those three, on any device kind, any
tensor-parallel group and any context-parallel group with the cost model's own formula
(:meth:`~pipewright.cost.transformer.TransformerCost.kind_time`): time = Σ GEMMs by shape (peak ×
gemm efficiency × tile/wave quantisation, or a calibration's measured rate) + attention-core FLOPs /
(peak × attention efficiency) + memory traffic / memory bandwidth + Σ tensor-parallel all-reduces over
the group's links (what the ``tp_comm_overlap`` mode leaves exposed beside the GEMMs, by the cost
model's rule) + per layer the ring-attention exchange over the cp group exposed beyond that layer's
attention + τ per layer (launch overhead); where the framework's dispatch model prices the host's
kernel launches (:mod:`pipewright.cost.dispatch`), each piece's time is the smooth maximum of that and
its launches' time, as the cost model prices a chunk (the two agree exactly on layers; a stage's
embedding or head is combined on its own, not with the stage's layers).
FSDP's per-layer re-gathering (pipeline size 1 only) is left to the full simulation.

It reads the cost model's per-chunk table through the public
:meth:`~pipewright.cost.transformer.TransformerCost.chunk_costs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

from pipewright.cost.comm import Mesh
from pipewright.cost.context_parallel import ring_gathered_bytes
from pipewright.cost.dispatch import cost_softmax_fused, launched
from pipewright.cost.gemm import gemm_seconds as gemm_seconds
from pipewright.cost.gemm import roofline
from pipewright.cost.layer import shared_table_parameters
from pipewright.cost.recompute import make_cost
from pipewright.cost.shape_scales import scales_of
from pipewright.cost.sharding import exposed, pipelined_fsdp_state, state_bytes
from pipewright.cost.tp_overlap import TpPass, block_times, layer_blocks, modes, pass_exposed, resolve
from pipewright.cost.transformer import (
    _OVERHEAD,
    A100_EFFICIENCY,
    DTYPE_BYTES,
    Efficiency,
)
from pipewright.hardware import Accelerator
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec
from pipewright.plan.cost_options import CostOptions
from pipewright.topology import single_host

Gemms = tuple[tuple[float, float, float, int], ...]  # (m, n, k, count) each


@dataclass(frozen=True)
class KindTerms:
    """What one kind of pass (F, I, W or B) of a piece runs, per microbatch, per device."""

    gemms: Gemms = ()
    attention: float = 0.0  # attention-core FLOPs executed
    traffic: float = 0.0  # memory-bound bytes moved
    tp: tuple[float, ...] = ()  # tensor-parallel all-reduce sizes (bytes)
    ring: float = 0.0  # bytes of the context-parallel KV exchange per layer
    a2a: int = 0  # expert all-to-alls over the expert-parallel group


#: The kinds a piece is priced for, in the order of :attr:`Part.kinds`.
KINDS = (F, I, W, B)
#: The kinds :func:`stage_cost` prices, in the order it reads them.
KINDS_PRICED = (F, B, I, W)


@dataclass(frozen=True)
class Part:
    """One piece of a stage (a layer, the embedding or the head), per microbatch, per device."""

    kinds: tuple[KindTerms, ...]  # F, I, W, B (:data:`KINDS`)
    activation: float  # bytes F stores
    params: float  # parameters per device
    layers: int = 0
    a2a_bytes: float = 0.0  # bytes one device sends in one expert all-to-all (MoECost.a2a_bytes)
    first: bool = False  # the embedding (its kernels' launches: cost.dispatch)
    last: bool = False  # the output layer and loss
    # (kind, gpu, dtype, efficiency) -> (GEMM, attention, rest) seconds: the terms that do not depend
    # on the tp/cp group, computed once per device kind (large meshes price thousands of groups)
    _local: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def a2a_f(self) -> int:
        """Expert all-to-alls in one forward."""
        return self.kinds[0].a2a

    @property
    def a2a_b(self) -> int:
        """Expert all-to-alls in one backward (B)."""
        return self.kinds[3].a2a

    def times(
        self,
        gpu: Accelerator,
        dtype: str,
        eff: Efficiency,
        all_reduce: Callable[[float], float],
        ring: Callable[[float], float] | None = None,
        options: Pricing | None = None,
        a2a: Callable[[float], float] | None = None,
        kinds: Sequence[str] = (F, B),
    ) -> tuple[float, ...]:
        """Seconds of each of ``kinds`` (default (forward, backward)) on ``gpu`` with the tp group's
        ``all_reduce(bytes)``, the cp group's ``ring(bytes)`` and the ep group's ``a2a(bytes)``
        (all-gathers) times (module docstring)."""
        o = options or Pricing()
        return tuple(self._time(k, gpu, dtype, eff, all_reduce, ring, o, a2a) for k in kinds)

    def _device_terms(self, kind, gpu, dtype, eff, o: Pricing) -> tuple[float, float, float]:
        """(GEMM, attention core, memory-bound traffic + layer overhead) seconds of ``kind`` on ``gpu``."""
        key = (kind, gpu.name, dtype, eff)
        hit = self._local.get(key)
        if hit is None:
            terms = self.kinds[KINDS.index(kind)]
            gemm = gemm_seconds(terms.gemms, gpu, dtype, eff, o.calibration)
            act_dtype = "bf16" if dtype == "fp8" else dtype
            bandwidth = gpu.memory_bandwidth if o.calibration is None else o.calibration.memory_bandwidth
            rate = gpu.peak(act_dtype) * eff.attention_rate
            attn = roofline(
                terms.attention, rate, o.attention_bytes, bandwidth
            )  # as TransformerCost.kind_time
            memory = terms.traffic / bandwidth
            overhead = self.layers * eff.layer_overhead * _OVERHEAD[kind]
            hit = self._local[key] = (gemm, attn, memory + overhead)
        return hit

    def _tp_exposed(self, kind, gpu, dtype, eff, all_reduce, o: Pricing, gemm: float) -> float:
        """Tensor-parallel seconds left exposed by ``o``'s --tp-comm-overlap mode, by the cost model's
        own rule (:mod:`pipewright.cost.tp_overlap`)."""
        collectives = tuple(map(all_reduce, self.kinds[KINDS.index(kind)].tp))
        if o.tp_comm_overlap == "none" and not o.sequence_parallel:
            return sum(collectives)

        def seconds(shapes) -> float:
            return gemm_seconds(tuple((*x, 1) for x in shapes), gpu, dtype, eff, o.calibration)

        def blocks():
            key = ("tp blocks", gpu.name, dtype, eff)
            hit = self._local.get(key)
            if hit is None:
                hit = self._local[key] = block_times(o.tp_blocks, seconds)
            return hit

        head = (lambda: seconds((o.tp_head,))) if self.last and o.tp_head else None
        tp_pass = TpPass(
            kind, collectives, gemm, self.layers, o.tp, o.full_recompute, blocks, o.sequence_parallel, head
        )
        return pass_exposed(modes()[o.tp_comm_overlap], tp_pass)

    def _time(self, kind, gpu, dtype, eff, all_reduce, ring, o: Pricing, a2a=None) -> float:
        terms = self.kinds[KINDS.index(kind)]
        gemm, attn, rest = self._device_terms(kind, gpu, dtype, eff, o)
        tp = self._tp_exposed(kind, gpu, dtype, eff, all_reduce, o, gemm)
        exchange = 0.0
        if ring is not None and self.layers and o.cp > 1:
            per_layer = ring(ring_gathered_bytes(terms.ring, o.cp))
            exchange = self.layers * exposed(per_layer, attn / self.layers)
        if a2a is not None and terms.a2a:
            exchange += terms.a2a * a2a(self.a2a_bytes)  # blocking, as MoECost.kind_time adds them
        calls = len(terms.tp) if o.tp > 1 else 0  # the launches' floor, as TransformerCost.kind_time
        gpu_seconds = gemm + attn + rest + tp + exchange
        fused, ends = o.softmax_fused, (self.first, self.last)
        seconds = launched(gpu_seconds, eff, self.layers, kind, o.full_recompute, calls, *ends, fused, tp)
        return seconds * o.scales[0 if self.layers else 1]  # as cost.dispatch.chunk_launched


@dataclass(frozen=True)
class Pricing:
    """What the cost model's time formula needs besides the pieces: its calibration, the
    --tp-comm-overlap mode with what its rule reads of a layer (the tensor-parallel size, whether the
    backward re-runs the forward, the layer's blocks: :func:`~pipewright.cost.tp_overlap.layer_blocks`),
    and the context-parallel size."""

    calibration: object = None
    tp_comm_overlap: str = "none"
    cp: int = 1
    tp: int = 1
    full_recompute: bool = False
    tp_blocks: tuple = ()
    attention_bytes: float = 0.0  # per FLOP of eager attention's batched GEMMs (TransformerCost's)
    softmax_fused: bool = True  # Megatron's fused softmax kernel runs (cost.dispatch.cost_softmax_fused)
    sequence_parallel: bool = False  # the backward re-gathers (cost.tp_overlap.pass_exposed)
    tp_head: tuple = ()  # the output layer's input-gradient GEMM (m, n, k), its re-gather hidden behind
    scales: tuple[float, float] = (1.0, 1.0)  # a calibration's measured (layers, ends) factors (shape_scales)


@dataclass(frozen=True)
class Parts:
    """The layer, embedding and head pieces of one (model, b, t, recompute, sp, dtype) choice."""

    layer: Part  # a layer with experts for a mixture-of-experts model
    embed: Part
    head: Part
    boundary_bytes: float  # one stage-boundary message (activation or its gradient)
    bytes_per_param: float
    grad_bytes: float
    pricing: Pricing = Pricing()
    dense: Part | None = None  # a mixture of experts' first dense layers (DeepSeek-V3: 3), one of them
    sharding: str = "none"  # optimizer-state sharding over dp × cp: none, zero1, fsdp
    grad_dtype: str = "fp32"  # the gradient buffer's element type
    fsdp_grad_sync: str = "microbatch"  # pipelined FSDP: when the gradients are reduce-scattered
    expert_params: float = 0.0  # routed-expert parameters per device in one MoE layer (of layer.params)
    ep: int = 1
    transient: float = 0.0  # one layer's recomputation transient (TransformerCost.layer_transient)
    shared_params: float = 0.0  # a tied model's table, held once where one stage has both ends

    def state(self, dp: int, pp: int) -> tuple[float, float]:
        """(dense, routed expert) bytes per parameter on one device with ``dp`` data-parallel replicas
        and ``pp`` stages, as the cost model's static memory prices them
        (:meth:`~pipewright.cost.transformer.TransformerCost.state`,
        :meth:`~pipewright.cost.moe_cost.MoECost.expert_state`): the optimizer state (zero1; and
        weights and gradients, fsdp) sharded over the dp × cp replicas, the routed experts' over their
        dp/ep × cp replicas; pipelined FSDP (pp > 1) keeps its 16-bit weights gathered for the step."""
        cp = self.pricing.cp
        dense = rank_state(self, dp * cp, pp)
        return dense, rank_state(self, dp // self.ep * cp, pp) if self.ep > 1 else dense


def rank_state(pc: Parts, replicas: int, pp: int) -> float:
    """Bytes per parameter of ``pc``'s choice over ``replicas`` sharing the state (:meth:`Parts.state`)."""
    state = state_bytes(pc.sharding, replicas, pc.bytes_per_param, pc.grad_dtype)
    if pc.sharding == "fsdp" and pp > 1:
        state = pipelined_fsdp_state(state, pc.fsdp_grad_sync, pc.grad_dtype)
    return state.total


def _part(chunk, t: int, a2a_bytes: float = 0.0, full: bool = False) -> Part:
    """The piece of one chunk table; ``a2a_bytes`` > 0: its MoE layers' all-to-alls over ep, 2 in the
    forward and 2 in the backward (4 under full recomputation), none in W, as MoECost.a2a_time counts
    them."""
    moe = getattr(chunk, "moe_layers", 0) if a2a_bytes > 0 else 0
    a2a = {F: 2 * moe, I: (4 if full else 2) * moe, W: 0, B: (4 if full else 2) * moe}
    kinds = tuple(
        KindTerms(
            tuple(chunk.gemms.get(k, ())),
            chunk.attention.get(k, 0.0),
            chunk.traffic.get(k, 0.0),
            tuple(chunk.tp_bytes.get(k, ())),
            chunk.ring_bytes.get(k, 0.0),
            a2a[k],
        )
        for k in KINDS
    )
    first, last = getattr(chunk, "first", False), getattr(chunk, "last", False)
    return Part(kinds, chunk.memory[F], chunk.params, chunk.layers, a2a_bytes, first, last)


#: The options of the classic cost model (eager attention, no cp, no sharding), the default.
EAGER = CostOptions(attention="eager")


def _priced_here(options: CostOptions) -> dict[str, object]:
    """``options``' cost-model keywords, less the attention kernel: its rate is already in the
    ``efficiency`` :func:`parts` is given (:meth:`~pipewright.plan.problem.Problem.efficiency_for`, on
    the candidate's accelerator), and the stand-in GPU these pieces are priced on is not that one."""
    kwargs = options.kwargs()
    kwargs.pop("attention_kernel", None)
    return kwargs


@cache
def parts(
    spec: ModelSpec,
    microbatch: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool,
    dtype: str,
    efficiency: Efficiency = A100_EFFICIENCY,
    options: CostOptions = EAGER,
    ep: int = 1,
    gpu: str | None = None,
) -> Parts:
    """The pieces, from the cost model (see the module docstring); cached per argument tuple.
    ``options``: attention, context parallelism, sharding, … (:mod:`pipewright.plan.cost_options`);
    ``ep``: expert-parallel size (a mixture of experts: its layer piece is an expert layer, priced by
    :class:`~pipewright.cost.moe_cost.MoECost` with the experts split over ep, and its first dense
    layers are a piece of their own)."""
    stand_in = gpu or ("cpu" if dtype == "fp32" else "a100-80gb")  # the pieces' FLOPs and bytes only
    mesh = Mesh(tp=tp) if options.cp == 1 else Mesh(tp=tp, cp=options.cp)
    if ep > 1:
        mesh = Mesh(tp=tp, cp=options.cp, dp=ep, ep=ep)
    cost = make_cost(
        recompute,
        spec=spec,
        microbatch=microbatch,
        gpu=stand_in,
        dtype=dtype,
        mesh=mesh,
        sequence_parallel=sequence_parallel,
        topology=single_host(mesh.size, stand_in),
        efficiency=efficiency,
        **_priced_here(options),
    )
    first = spec.moe_dense_layers if spec.is_moe else 0
    layer = cost.chunk_costs(1, (first, 1, 0))  # layer `first`: an expert layer for a MoE model
    a2a = cost.a2a_bytes() if ep > 1 else 0.0
    full = recompute == "full"
    dense = _part(cost.chunk_costs(1, (0, 1, 0)), tp) if first else None
    embed = cost.chunk_costs(0, (0, 1, 0))
    head = cost.chunk_costs(2, (0, 1, 0))
    # one stage-boundary message per device, as TransformerCost.message_bytes: each cp rank sends its s/c
    act = spec.seq_len * microbatch * spec.hidden * DTYPE_BYTES[dtype] / options.cp
    split = cost.scatter_gather or sequence_parallel
    return Parts(
        _part(layer, tp, a2a, full),
        _part(embed, tp),
        _part(head, tp),
        act / tp if split else act,
        cost.bytes_per_param,
        cost.grad_bytes,
        Pricing(
            getattr(cost, "calibration", None),
            resolve(getattr(cost, "tp_comm_overlap", False)),
            getattr(cost, "cp", 1),
            tp,
            full,
            layer_blocks(spec, microbatch * spec.seq_len / options.cp, tp),
            getattr(cost, "attention_bytes", 0.0),
            cost_softmax_fused(cost),
            sequence_parallel and tp > 1,
            (microbatch * spec.seq_len / options.cp, spec.hidden, spec.vocab / tp),
            scales_of(cost),
        ),
        dense,
        getattr(cost, "optimizer_sharding", "none"),
        getattr(cost, "grad_dtype", "fp32"),
        getattr(cost, "fsdp_grad_sync", "microbatch"),
        cost.routed_params() if spec.is_moe else 0.0,
        ep,
        cost.layer_transient(),
        shared_table_parameters(spec, tp),
    )


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one pipeline rank's pieces on its device and tp group (per microbatch)."""

    layer_f: float
    layer_b: float
    embed_f: float
    embed_b: float
    head_f: float
    head_b: float
    layer_static: float  # bytes: parameters × bytes per parameter
    embed_static: float
    head_static: float
    layer_act: float
    embed_act: float
    head_act: float
    dense: float = 0.0  # F + B seconds of a first dense layer of a mixture of experts (0: none)
    transient: float = 0.0  # bytes a recomputing backward holds on top of the stored activations
    # (I, W) seconds of the layer, the embedding and the head where an order runs the backward as
    # its two passes (zero-bubble, V shapes); None: half of B each
    layer_iw: tuple[float, float] | None = None
    embed_iw: tuple[float, float] | None = None
    head_iw: tuple[float, float] | None = None
    #: bytes of a tied model's table that a stage with both the embedding and the head holds once
    #: (:func:`~pipewright.cost.layer.shared_table_parameters` × bytes per parameter)
    shared_static: float = 0.0

    @property
    def layer(self) -> float:
        return self.layer_f + self.layer_b

    def split(self) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """(I, W) seconds of the layer, the embedding and the head (half of B each where not priced)."""
        backs = ((self.layer_iw, self.layer_b), (self.embed_iw, self.embed_b), (self.head_iw, self.head_b))
        return tuple(iw if iw is not None else (b / 2, b / 2) for iw, b in backs)  # type: ignore[return-value]

    def layer_weights(self, spec: ModelSpec) -> list[float] | None:
        """Each layer's seconds in units of :attr:`layer` where they differ: a mixture of experts' first
        dense layers weigh dense/layer (the partition's weights; their memory is taken at the same
        weight, an over-estimate when experts hold most bytes); None when every layer is alike."""
        first = spec.moe_dense_layers if spec.is_moe else 0
        if not first or not self.dense:
            return None
        return [self.dense / self.layer] * first + [1.0] * (spec.layers - first)

    def time(self, layers: int, first: bool, last: bool) -> float:
        """F + B seconds of a stage with ``layers`` layers (embedding if ``first``, head if ``last``)."""
        return (
            layers * self.layer + first * (self.embed_f + self.embed_b) + last * (self.head_f + self.head_b)
        )

    def static(self, layers: int, first: bool, last: bool) -> float:
        """Bytes of the parameters' state of a stage with ``layers`` layers (embedding if ``first``,
        head if ``last``; a tied table once when both, as the cost model's chunk)."""
        shared = self.shared_static if first and last else 0.0
        return layers * self.layer_static + first * self.embed_static + last * self.head_static - shared

    def memory(self, layers: int, first: bool, last: bool, in_flight: float) -> float:
        """Static bytes + ``in_flight`` microbatches of activations."""
        static = self.static(layers, first, last)
        act = layers * self.layer_act + first * self.embed_act + last * self.head_act
        return static + in_flight * act


def stage_cost(
    p: Parts,
    gpu: Accelerator,
    dtype: str,
    eff: Efficiency,
    all_reduce: Callable[[float], float],
    ring: Callable[[float], float] | None = None,
    a2a: Callable[[float], float] | None = None,
    state: tuple[float, float] | None = None,
) -> StageCost:
    """Price the pieces on ``gpu`` with the tensor-parallel group's ``all_reduce``, the
    context-parallel group's ``ring`` and the expert-parallel group's ``a2a`` (all-gather) times;
    without ``ring`` or ``a2a`` that exchange is free. ``state``: (dense, routed expert) bytes per
    parameter (:meth:`Parts.state` for the candidate's dp and pp; default unsharded)."""
    args = (gpu, dtype, eff, all_reduce, ring, p.pricing, a2a)
    lf, lb, li, lw = p.layer.times(*args, kinds=KINDS_PRICED)
    ef, eb, ei, ew = p.embed.times(*args, kinds=KINDS_PRICED)
    hf, hb, hi, hw = p.head.times(*args, kinds=KINDS_PRICED)
    dense = sum(p.dense.times(*args)) if p.dense is not None else 0.0
    bpp, expert_bpp = state or p.state(1, 1)
    layer_static = (p.layer.params - p.expert_params) * bpp + p.expert_params * expert_bpp
    return StageCost(
        lf, lb, ef, eb, hf, hb,
        layer_static, p.embed.params * bpp, p.head.params * bpp,
        p.layer.activation, p.embed.activation, p.head.activation, dense, p.transient,
        (li, lw), (ei, ew), (hi, hw), p.shared_params * bpp,
    )  # fmt: skip


def slowest(costs: Sequence[StageCost]) -> StageCost:
    """The element-wise slowest of several devices' costs (a stage replicated over dp runs at the pace
    of its slowest replica)."""
    return max(costs, key=lambda c: c.layer)
