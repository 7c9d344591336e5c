"""Per-layer costs for the planner, read off the transformer cost model's chunk tables.

A stage holding n transformer layers (plus the embedding on the first stage, the output layer and loss
on the last) costs, per microbatch, n × (one layer) + embedding + head — every term of
:class:`~pipewright.cost.transformer.TransformerCost` is linear in the layer count. So the planner asks
the cost model once for a one-layer middle chunk, a layer-free first chunk (the embedding) and a
layer-free last chunk (the head) and prices any stage from those three, on any device kind and any
tensor-parallel group: time = FLOPs / (peak × gemm efficiency) + memory traffic / memory bandwidth +
Σ tensor-parallel all-reduces over the group's links (the cost model's own formula).

It reads the cost model's per-chunk table through the public
:meth:`~pipewright.cost.transformer.TransformerCost.chunk_costs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from pipewright.cost.comm import Mesh
from pipewright.cost.recompute import make_cost
from pipewright.cost.transformer import A100_EFFICIENCY, DTYPE_BYTES, Efficiency
from pipewright.hardware import Accelerator
from pipewright.ir import B, F
from pipewright.models.spec import ModelSpec
from pipewright.plan.options import CostOptions
from pipewright.topology import single_host


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

    def times(
        self, gpu: Accelerator, dtype: str, eff: Efficiency, all_reduce: Callable[[float], float]
    ) -> tuple[float, float]:
        """(forward, backward) seconds on ``gpu`` with the tp group's ``all_reduce(bytes)`` time."""
        peak = gpu.peak(dtype) * eff.gemm
        f = self.flops_f / peak + self.traffic_f / gpu.memory_bandwidth + sum(map(all_reduce, self.tp_f))
        b = self.flops_b / peak + self.traffic_b / gpu.memory_bandwidth + sum(map(all_reduce, self.tp_b))
        return f, b


@dataclass(frozen=True)
class Parts:
    """The layer, embedding and head pieces of one (model, b, t, recompute, sp, dtype) choice."""

    layer: Part
    embed: Part
    head: Part
    boundary_bytes: float  # one stage-boundary message (activation or its gradient)
    bytes_per_param: float
    grad_bytes: float


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
    p: Parts, gpu: Accelerator, dtype: str, eff: Efficiency, all_reduce: Callable[[float], float]
) -> StageCost:
    """Price the pieces on ``gpu`` with the tensor-parallel group's ``all_reduce``."""
    lf, lb = p.layer.times(gpu, dtype, eff, all_reduce)
    ef, eb = p.embed.times(gpu, dtype, eff, all_reduce)
    hf, hb = p.head.times(gpu, dtype, eff, all_reduce)
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
