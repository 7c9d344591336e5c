"""Analytical cost of GPT/BERT training actions (Megatron-LM's FLOP counts, Korthikanti et al.'s memory).

A schedule's stage (model chunk) c of n holds a contiguous range of transformer layers (uniform by
default, the first ``l mod n`` chunks one layer more); chunk 0 also holds the embedding, chunk n − 1 the
output (logit) layer and the loss. Per microbatch of b sequences of length s, hidden h, FFN f, heads a,
vocabulary V, tensor-parallel size t:

- FLOPs, forward of one layer: 8·b·s·h² + 4·b·s·h·f + 4·b·s²·h (= 24·b·s·h² + 4·b·s²·h for f = 4h);
  logit layer 2·b·s·h·V; embedding 0. Backward = 2 × forward; full recomputation adds one forward of
  the layers (not of the logit layer, as in Megatron) to B. I and W each take half of the backward's
  FLOPs; the recomputed forward belongs to I (it is needed first). Every device does 1/t of them.
- Time = FLOPs / t / (peak(dtype) × :attr:`Efficiency.gemm`) + memory-bound kernels' bytes / memory
  bandwidth (:attr:`Efficiency.memory_traffic`; layers only) + tensor-parallel communication:
  two all-reduces of b·s·h elements per layer in the forward, two in the backward (both in I), two
  more with recomputation; with sequence parallelism an all-gather plus a reduce-scatter replace each
  all-reduce (the same ring time). The vocabulary-parallel embedding all-reduces b·s·h in F; the
  vocabulary-parallel cross-entropy all-reduces 3 × b·s fp32 values in F, and the logit layer's
  input gradient b·s·h in B/I.
- Stage-boundary messages: b·s·h elements, / t with Megatron's scatter/gather (or sequence parallelism).
- Activation memory added by F, per layer (16-bit activations; Korthikanti et al. 2022):
  s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes, s·b·h·(34 + 5·a·s/h)/t with sequence parallelism (both
  34·s·b·h + 5·a·s²·b at t = 1); with full recomputation only the layer input, 2·s·b·h (/t with sequence
  parallelism). ``attention="flash"`` (fused attention, FlashAttention, Dao et al. 2022): the a·s² scores,
  their softmax and dropout mask are never stored nor moved through memory — the 5·a·s/(h·t) term
  leaves both the activation and the memory-traffic formula (Korthikanti et al.'s selective-recompute
  memory, s·b·h·(10 + 24/t), 34·s·b·h/t with sequence parallelism) — and the backward recomputes the
  scores Q·Kᵀ: +2·b·s²·h executed FLOPs per layer in B (and I), not counted as model FLOPs.
  Chunk 0 adds the embedding output (s·b·h elements), the last chunk the fp32 logits (4·b·s·V/t bytes).
  W frees 32·s·b·h/t per layer (the inputs of its linear layers; nothing with recomputation), I frees
  the rest, B everything (Zero Bubble's accounting).
- Parameters per layer 4h² + 2hf + 9h + f (= 12h² + 13h), embedding (V + s)·h on chunk 0, a V·h output
  layer (or the tied copy) and the final LayerNorm on the last chunk; static memory = parameters / t ×
  ``bytes_per_param`` (18 by default: fp16 weight 2 + fp32 gradient accumulator 4 + fp32 master weight 4
  + Adam's two fp32 moments 8, Megatron's mixed precision); REDUCE_GRAD sends ``grad_bytes`` per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pipewright.cost.comm import Mesh, TopologyComm
from pipewright.cost.placement import layer_counts, roles
from pipewright.errors import ConfigError
from pipewright.hardware import accelerator
from pipewright.ir import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, Action, B, F, I, Schedule, W
from pipewright.models.layout import Layout
from pipewright.models.spec import ModelSpec
from pipewright.topology import Topology, cluster, single_host

DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1})
RECOMPUTE = ("none", "full")
ATTENTION = ("eager", "flash")  # eager: the a·s² scores are stored (Korthikanti et al.); flash: fused
_MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Efficiency:
    """How close to the hardware's peaks the kernels run — the explicit, calibrated part of the model.

    - ``gemm``: fraction of peak FLOP/s the matrix multiplications reach.
    - ``memory_traffic`` κ: bytes the memory-bound kernels of a layer (LayerNorm, dropout, residual
      adds, bias-GeLU, softmax and masking over the a·s² attention scores) move through device memory in
      the forward, per byte of activation a forward without recomputation stores (Korthikanti et al.:
      s·b·h·(10 + 24/t + 5·a·s/(h·t))); the backward moves twice that, a recomputed forward once more;
      the time is bytes / memory bandwidth. This term is why small hidden sizes and long sequences fall
      short of the GEMM rate.
    - ``comm``: fraction of link bandwidth that collectives and point-to-point transfers reach (NCCL's
      bus bandwidth over the link's peak).

    The defaults are calibrated for A100 (fp16, Selene) on Megatron-LM Table 1: with gemm 0.67,
    κ 2.25 and comm 0.8, the predicted TFLOP/s per GPU of all ten rows is within 5 % of the published
    ones (``tools/table1.py``; docs/simulator.md, "Fidelity: Megatron-LM Table 1").
    """

    gemm: float = 0.67
    memory_traffic: float = 2.25
    comm: float = 0.8


#: The calibrated A100 parameters (the dataclass defaults).
A100_EFFICIENCY = Efficiency()


def layer_forward_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of one transformer layer: 8bsh² + 4bshf + 4bs²h (Megatron-LM: 24bsh² + 4bs²h)."""
    s, h, f = spec.seq_len, spec.hidden, spec.ffn_hidden
    return 8 * b * s * h * h + 4 * b * s * h * f + 4 * b * s * s * h


def logit_forward_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of the output layer: 2·b·s·h·V."""
    return 2 * b * spec.seq_len * spec.hidden * spec.vocab


def layer_parameters(spec: ModelSpec) -> int:
    """Parameters of one layer: 4h² + 2hf + 9h + f (= 12h² + 13h for f = 4h)."""
    h, f = spec.hidden, spec.ffn_hidden
    return 4 * h * h + 2 * h * f + 9 * h + f


def megatron_flops_per_iteration(spec: ModelSpec, global_batch: int, recompute: str = "full") -> float:
    """Megatron-LM (SC21, eq. 3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation,
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without."""
    B, s, l, h, V = global_batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab
    if recompute == "full":
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_parameters(spec: ModelSpec) -> float:
    """Megatron-LM: 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def default_topology(gpu: str, devices: int) -> Topology:
    """Where no topology is given: 8-GPU NVLink machines on InfiniBand HDR (one NIC per GPU), or, for
    ``cpu``, processes of this machine on gloo loopback."""
    if gpu == "cpu":
        return single_host(devices)
    per_node = min(devices, 8)
    intra = "nvlink" if accelerator(gpu).nvlink else "pcie4"
    return cluster(math.ceil(devices / per_node), per_node, gpu, intra=intra)


@dataclass(frozen=True)
class _Chunk:
    """Per-microbatch costs of one chunk, per device (tensor-parallel share)."""

    flops: Mapping[str, float]  # F, B, I, W executed (recomputation included)
    model_flops: Mapping[str, float]  # without recomputation
    tp_bytes: Mapping[str, tuple[float, ...]]  # all-reduce sizes per kind
    traffic: Mapping[str, float]  # bytes the memory-bound kernels move per kind
    memory: Mapping[str, float]
    params: float


@dataclass(frozen=True, eq=False)
class TransformerCost:
    """Analytical :class:`~pipewright.cost.base.CostModel` (formulas: module docstring).

    ``layout``: layers per chunk (length = the schedule's number of stages), or a
    :class:`~pipewright.models.layout.Layout`, which also says which stages hold the embedding and the
    output layer with its loss (:mod:`pipewright.cost.placement`); ``None`` = uniform.
    ``topology``/``mesh``: where ranks run (:class:`~pipewright.cost.comm.Mesh` order); without a
    topology, :func:`default_topology` of ``gpu``. ``extra_times``: seconds of extension compute kinds
    (e.g. K-FAC tasks), 0 when absent. ``attention``: ``eager`` (default; the attention scores are
    stored) or ``flash`` (fused attention: no a·s² storage or traffic, scores recomputed in the backward).
    """

    spec: ModelSpec
    microbatch: int = 1
    gpu: str = "a100-80gb"
    dtype: str = "bf16"
    recompute: str = "none"
    mesh: Mesh = field(default_factory=Mesh)
    sequence_parallel: bool = False
    scatter_gather: bool = True
    topology: Topology | None = None
    efficiency: Efficiency = A100_EFFICIENCY
    layout: Sequence[int] | Layout | None = None
    bytes_per_param: float = 18.0
    grad_bytes: float = 2.0
    extra_times: Mapping[str, float] = field(default_factory=dict)
    attention: str = "eager"
    comm: TopologyComm = field(init=False, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE)} (got {self.recompute!r})")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION)} (got {self.attention!r})")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
        if self.microbatch < 1:
            raise ConfigError(f"--microbatch-size must be at least 1 (got {self.microbatch})")
        if self.spec.heads % self.mesh.tp or self.spec.ffn_hidden % self.mesh.tp:
            raise ConfigError(f"--tp {self.mesh.tp} must divide the heads ({self.spec.heads}) and FFN size")
        topology = self.topology or default_topology(self.gpu, self.mesh.size)
        object.__setattr__(self, "topology", topology)
        object.__setattr__(self, "comm", TopologyComm(topology, self.mesh, self.efficiency.comm))
        for rank in range(self.mesh.pp):
            topology.accelerator(self.comm.device(rank)).peak(self.dtype)  # one-line error if it has none

    # -- per-chunk tables ---------------------------------------------------------------------------
    def layers_of(self, schedule: Schedule) -> tuple[int, ...]:
        return layer_counts(self.layout, self.spec.layers, schedule.num_stages)

    def _chunk(self, stage: int, schedule: Schedule) -> _Chunk:
        key = (stage, schedule.num_stages)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._build_chunk(stage, schedule.num_stages, self.layers_of(schedule))
        return hit

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        spec, b, t = self.spec, self.microbatch, self.mesh.tp
        s, h, a, V = spec.seq_len, spec.hidden, spec.heads, spec.vocab
        n_layers = layers[stage]
        first, last = roles(self.layout, stage, num_stages)
        full = self.recompute == "full"
        esize = DTYPE_BYTES[self.dtype]
        fwd = n_layers * layer_forward_flops(spec, b)
        logit = logit_forward_flops(spec, b) if last else 0.0
        half_bwd = fwd + logit  # half of the 2× backward
        recomputed = fwd if full else 0.0
        if self.attention == "flash":  # the backward recomputes the scores Q·Kᵀ (2·b·s²·h per layer)
            recomputed += n_layers * 2 * b * s * s * h
        model = {F: fwd + logit, B: 2 * half_bwd, I: half_bwd, W: half_bwd}
        executed = {F: model[F], B: model[B] + recomputed, I: model[I] + recomputed, W: model[W]}
        act = s * b * h * esize  # one b·s·h activation tensor
        per_layer_ar = (act,) * 2 * n_layers
        tp_bytes: dict[str, tuple[float, ...]] = {
            F: per_layer_ar,
            I: per_layer_ar * (2 if full else 1),
            W: (),
        }
        if first:
            tp_bytes[F] += (act,)
        if last:
            tp_bytes[F] += (4.0 * b * s,) * 3
            tp_bytes[I] += (act,)
        tp_bytes[B] = tp_bytes[I] + tp_bytes[W]
        # activation memory (16-bit formulas scaled by element size / 2)
        scale = esize / 2
        scores = 0.0 if self.attention == "flash" else 5 * a * s / h  # the a·s² scores, per s·b·h
        stored = s * b * h * (10 + 24 / t + scores / t) * scale  # a forward without recomputation
        if self.sequence_parallel:
            stored = s * b * h * (34 + scores) / t * scale
        fwd_traffic = self.efficiency.memory_traffic * n_layers * stored
        redo = fwd_traffic if full else 0.0
        traffic = {F: fwd_traffic, B: 2 * fwd_traffic + redo, I: fwd_traffic + redo, W: fwd_traffic}
        if full:
            per_layer = 2 * s * b * h * scale / (t if self.sequence_parallel else 1)
            w_frees = 0.0
        else:
            per_layer = stored
            w_frees = 32 * s * b * h / t * scale
        added = n_layers * per_layer + (act if first else 0.0) + (4.0 * b * s * V / t if last else 0.0)
        memory = {F: added, B: -added, W: -n_layers * w_frees, I: -(added - n_layers * w_frees)}
        params = n_layers * layer_parameters(spec) / t
        if first:
            params += V * h / t + s * h
        if last:
            params += V * h / t + 2 * h
        return _Chunk(
            MappingProxyType({k: v / t for k, v in executed.items()}),
            MappingProxyType({k: v / t for k, v in model.items()}),
            MappingProxyType(tp_bytes),
            MappingProxyType(traffic),
            MappingProxyType(memory),
            params,
        )

    # -- CostModel ----------------------------------------------------------------------------------
    def compute_time(self, action: Action, schedule: Schedule) -> float:
        kind = action.kind
        if not schedule.kinds[kind].compute:
            return 0.0
        if kind not in (F, B, I, W):
            return float(self.extra_times.get(kind, 0.0))
        rank = schedule.rank_of(action.stage)
        key = ("time", action.stage, kind, schedule.num_stages, rank)
        hit = self._cache.get(key)
        if hit is None:
            chunk = self._chunk(action.stage, schedule)
            gpu = self.topology.accelerator(self.comm.device(rank))
            gemm = chunk.flops[kind] / (gpu.peak(self.dtype) * self.efficiency.gemm)
            memory = chunk.traffic[kind] / gpu.memory_bandwidth
            comm = sum(self.comm.tp_all_reduce_time(rank, n) for n in chunk.tp_bytes[kind])
            hit = self._cache[key] = gemm + memory + comm
        return hit

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind in _MESSAGES:
            act = self.spec.seq_len * self.microbatch * self.spec.hidden * DTYPE_BYTES[self.dtype]
            split = self.scatter_gather or self.sequence_parallel
            return act / self.mesh.tp if split else act
        if action.kind == REDUCE_GRAD:
            return self._chunk(action.stage, schedule).params * self.grad_bytes
        return 0.0

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind not in (F, B, I, W):
            return 0.0
        return self._chunk(action.stage, schedule).memory[action.kind]

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        return sum(self._chunk(c, schedule).params for c in schedule.stages_of(rank)) * self.bytes_per_param

    def flops(self, action: Action, schedule: Schedule) -> float:
        if action.kind not in (F, B, I, W):
            return 0.0
        return self._chunk(action.stage, schedule).flops[action.kind]

    def model_flops(self, action: Action, schedule: Schedule) -> float:
        if action.kind not in (F, B, I, W):
            return 0.0
        return self._chunk(action.stage, schedule).model_flops[action.kind]

    def parameters(self, schedule: Schedule) -> float:
        """Parameters of the whole model as laid out (per tensor-parallel rank × t)."""
        return sum(self._chunk(c, schedule).params for c in range(schedule.num_stages)) * self.mesh.tp

    def chunk_costs(self, stage: int, layers: Sequence[int]) -> _Chunk:
        """Per-microbatch costs, per device, of chunk ``stage`` when the chunks hold ``layers[c]``
        transformer layers each (chunk 0 also the embedding, the last one the output layer and loss):
        executed and model FLOPs, tensor-parallel all-reduce sizes, memory-bound traffic and activation
        bytes per kind (F, B, I, W), and parameters per device — the table every method above reads.
        Subclasses that adjust the table (recomputation modes, other model families) are honoured. The
        planner prices any stage from ``chunk_costs(1, (0, 1, 0))`` (one layer), ``chunk_costs(0, (0, 1,
        0))`` (the embedding) and ``chunk_costs(2, (0, 1, 0))`` (the head)."""
        return self._build_chunk(stage, len(layers), tuple(layers))
