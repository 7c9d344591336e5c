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
the group's links (exposed beyond the GEMMs with ``tp_comm_overlap``) + per layer the ring-attention
exchange over the cp group exposed beyond that layer's attention + τ per layer (launch overhead).
FSDP's per-layer re-gathering (pipeline size 1 only) is left to the full simulation.

It reads the cost model's per-chunk table through the public
:meth:`~pipewright.cost.transformer.TransformerCost.chunk_costs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

from pipewright.cost.comm import Mesh
from pipewright.cost.gemm import wave_efficiency
from pipewright.cost.recompute import make_cost
from pipewright.cost.sharding import exposed
from pipewright.cost.transformer import (
    _OVERHEAD,
    A100_EFFICIENCY,
    DTYPE_BYTES,
    Efficiency,
    ring_gathered_bytes,
)
from pipewright.hardware import Accelerator
from pipewright.ir import B, F
from pipewright.models.spec import ModelSpec
from pipewright.plan.options import CostOptions
from pipewright.topology import single_host

Gemms = tuple[tuple[float, float, float, int], ...]  # (m, n, k, count) each


def gemm_seconds(gemms: Gemms, gpu: Accelerator, dtype: str, eff: Efficiency, calibration=None) -> float:
    """Seconds of ``gemms`` on ``gpu``, as :meth:`TransformerCost.gemm_time` prices them: a calibration's
    measured rate for the shape, else peak × gemm efficiency (× fp8 factor) × wave quantisation."""
    peak = gpu.peak(dtype)
    base, sms = eff.gemm * (eff.fp8 if dtype == "fp8" else 1.0), gpu.sms if eff.waves else 0
    total = 0.0
    for m, n, k, count in gemms:
        rate = None if calibration is None else calibration.gemm_flops_per_second(m, n, k, dtype)
        if rate is None:
            rate = peak * base * wave_efficiency(m, n, sms)
        total += count * 2 * m * n * k / rate
    return total


@dataclass(frozen=True)
class Part:
    """One piece of a stage (a layer, the embedding or the head), per microbatch, per device."""

    flops_f: float
    flops_b: float
    traffic_f: float
    traffic_b: float
    tp_f: tuple[float, ...]  # all-reduce sizes (bytes) in F
    tp_b: tuple[float, ...]
    activation: float  # bytes F stores
    params: float  # parameters per device
    gemms_f: Gemms = ()
    gemms_b: Gemms = ()
    attention_f: float = 0.0  # attention-core FLOPs executed
    attention_b: float = 0.0
    ring_f: float = 0.0  # bytes of the context-parallel KV exchange per layer
    ring_b: float = 0.0
    layers: int = 0
    # (kind, gpu, dtype, efficiency) -> (GEMM, attention, rest) seconds: the terms that do not depend
    # on the tp/cp group, computed once per device kind (large meshes price thousands of groups)
    _local: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def times(
        self,
        gpu: Accelerator,
        dtype: str,
        eff: Efficiency,
        all_reduce: Callable[[float], float],
        ring: Callable[[float], float] | None = None,
        options: Pricing | None = None,
    ) -> tuple[float, float]:
        """(forward, backward) seconds on ``gpu`` with the tp group's ``all_reduce(bytes)`` and the cp
        group's ``ring(bytes)`` (an all-gather) times (module docstring)."""
        o = options or Pricing()
        return (
            self._time(F, gpu, dtype, eff, all_reduce, ring, o),
            self._time(B, gpu, dtype, eff, all_reduce, ring, o),
        )

    def _device_terms(self, kind, gpu, dtype, eff, o: Pricing) -> tuple[float, float, float]:
        """(GEMM, attention core, memory-bound traffic + layer overhead) seconds of ``kind`` on ``gpu``."""
        key = (kind, gpu.name, dtype, eff)
        hit = self._local.get(key)
        if hit is None:
            fwd = kind == F
            gemm = gemm_seconds(self.gemms_f if fwd else self.gemms_b, gpu, dtype, eff, o.calibration)
            act_dtype = "bf16" if dtype == "fp8" else dtype
            attn = (self.attention_f if fwd else self.attention_b) / (
                gpu.peak(act_dtype) * eff.attention_rate
            )
            bandwidth = gpu.memory_bandwidth if o.calibration is None else o.calibration.memory_bandwidth
            memory = (self.traffic_f if fwd else self.traffic_b) / bandwidth
            overhead = self.layers * eff.layer_overhead * _OVERHEAD[kind]
            hit = self._local[key] = (gemm, attn, memory + overhead)
        return hit

    def _time(self, kind, gpu, dtype, eff, all_reduce, ring, o: Pricing) -> float:
        fwd = kind == F
        gemm, attn, rest = self._device_terms(kind, gpu, dtype, eff, o)
        tp = sum(map(all_reduce, self.tp_f if fwd else self.tp_b))
        if o.tp_comm_overlap:
            tp = exposed(tp, gemm)
        exchange = 0.0
        if ring is not None and self.layers and o.cp > 1:
            per_layer = ring(ring_gathered_bytes(self.ring_f if fwd else self.ring_b, o.cp))
            exchange = self.layers * exposed(per_layer, attn / self.layers)
        return gemm + attn + rest + tp + exchange


@dataclass(frozen=True)
class Pricing:
    """What the cost model's time formula needs besides the pieces: its calibration, whether
    tensor-parallel communication overlaps the GEMMs, and the context-parallel size."""

    calibration: object = None
    tp_comm_overlap: bool = False
    cp: int = 1


@dataclass(frozen=True)
class Parts:
    """The layer, embedding and head pieces of one (model, b, t, recompute, sp, dtype) choice."""

    layer: Part
    embed: Part
    head: Part
    boundary_bytes: float  # one stage-boundary message (activation or its gradient)
    bytes_per_param: float
    grad_bytes: float
    pricing: Pricing = Pricing()


def _part(chunk, t: int) -> Part:
    return Part(
        chunk.flops[F],
        chunk.flops[B],
        chunk.traffic[F],
        chunk.traffic[B],
        tuple(chunk.tp_bytes[F]),
        tuple(chunk.tp_bytes[B]),
        chunk.memory[F],
        chunk.params,
        tuple(chunk.gemms.get(F, ())),
        tuple(chunk.gemms.get(B, ())),
        chunk.attention.get(F, 0.0),
        chunk.attention.get(B, 0.0),
        chunk.ring_bytes.get(F, 0.0),
        chunk.ring_bytes.get(B, 0.0),
        chunk.layers,
    )


#: The options of the classic cost model (eager attention, no cp, no sharding), the default.
EAGER = CostOptions(attention="eager")


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
) -> Parts:
    """The pieces, from the cost model (see the module docstring); cached per argument tuple.
    ``options``: attention, context parallelism, sharding, … (:mod:`pipewright.plan.options`)."""
    cost = make_cost(
        recompute,
        spec=spec,
        microbatch=microbatch,
        gpu="cpu" if dtype == "fp32" else "a100-80gb",
        dtype=dtype,
        mesh=Mesh(tp=tp) if options.cp == 1 else Mesh(tp=tp, cp=options.cp),
        sequence_parallel=sequence_parallel,
        topology=single_host(tp * options.cp, "cpu" if dtype == "fp32" else "a100-80gb"),
        efficiency=efficiency,
        **options.kwargs(),
    )
    layer = cost.chunk_costs(1, (0, 1, 0))
    embed = cost.chunk_costs(0, (0, 1, 0))
    head = cost.chunk_costs(2, (0, 1, 0))
    act = spec.seq_len * microbatch * spec.hidden * DTYPE_BYTES[dtype]
    split = cost.scatter_gather or sequence_parallel
    return Parts(
        _part(layer, tp),
        _part(embed, tp),
        _part(head, tp),
        act / tp if split else act,
        cost.bytes_per_param,
        cost.grad_bytes,
        Pricing(
            getattr(cost, "calibration", None),
            getattr(cost, "tp_comm_overlap", False),
            getattr(cost, "cp", 1),
        ),
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

    @property
    def layer(self) -> float:
        return self.layer_f + self.layer_b

    def time(self, layers: int, first: bool, last: bool) -> float:
        """F + B seconds of a stage with ``layers`` layers (embedding if ``first``, head if ``last``)."""
        return (
            layers * self.layer + first * (self.embed_f + self.embed_b) + last * (self.head_f + self.head_b)
        )

    def memory(self, layers: int, first: bool, last: bool, in_flight: float) -> float:
        """Static bytes + ``in_flight`` microbatches of activations."""
        static = layers * self.layer_static + first * self.embed_static + last * self.head_static
        act = layers * self.layer_act + first * self.embed_act + last * self.head_act
        return static + in_flight * act


def stage_cost(
    p: Parts,
    gpu: Accelerator,
    dtype: str,
    eff: Efficiency,
    all_reduce: Callable[[float], float],
    ring: Callable[[float], float] | None = None,
) -> StageCost:
    """Price the pieces on ``gpu`` with the tensor-parallel group's ``all_reduce`` and the
    context-parallel group's ``ring`` (all-gather) times; without ``ring`` the exchange is free."""
    args = (gpu, dtype, eff, all_reduce, ring, p.pricing)
    lf, lb = p.layer.times(*args)
    ef, eb = p.embed.times(*args)
    hf, hb = p.head.times(*args)
    bpp = p.bytes_per_param
    return StageCost(
        lf, lb, ef, eb, hf, hb,
        p.layer.params * bpp, p.embed.params * bpp, p.head.params * bpp,
        p.layer.activation, p.embed.activation, p.head.activation,
    )  # fmt: skip


def slowest(costs: Sequence[StageCost]) -> StageCost:
    """The element-wise slowest of several devices' costs (a stage replicated over dp runs at the pace
    of its slowest replica)."""
    return max(costs, key=lambda c: c.layer)
