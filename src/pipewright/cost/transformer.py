"""Analytical cost of decoder-transformer training actions (GPT, BERT, Llama and any dense decoder).

A schedule's stage (model chunk) c of n holds a contiguous range of transformer layers (uniform by
default, the first ``l mod n`` chunks one layer more); chunk 0 also holds the embedding, chunk n − 1 the
output (logit) layer and the loss. Per microbatch of b sequences of length s, hidden h, heads a,
vocabulary V, tensor-parallel size t, context-parallel size c (each device holds s/c tokens); the
per-layer terms are :mod:`pipewright.cost.layer`'s (GEMM shapes, attention, stored bytes):

- FLOPs: forward = the layer GEMMs + attention (Megatron-LM's 24bsh² + 4bs²h for GPT) + the logit
  layer 2·b·s·h·V; the backward = 2 × forward, split by what it is (Zero Bubble, Qi et al. 2024): I
  runs the input-gradient GEMMs (as many FLOPs as the forward's GEMMs), the attention backward (2 × its
  forward) and the logit layer's input gradient; W runs the weight-gradient GEMMs only. Recomputation
  adds to I (and B): full the layer forward (``checkpoint="non-reentrant"``: less its last GEMM, which
  PyTorch's checkpoint does not re-run), selective the attention core (with flash attention too:
  Megatron-LM's ``checkpoint_core_attention`` wraps whatever kernel runs the core);
  ``attention="flash"`` (FlashAttention, Dao et al. 2022) recomputes Q·Kᵀ in its backward,
  +2·b·s²·h per layer, not counted as model FLOPs. Every device does 1/(t·c) of them.
- Time of an action = its GEMMs, each priced by shape (:mod:`pipewright.cost.gemm`: the GPU's base
  GEMM efficiency × tile/wave quantisation over its SMs, or a measured calibration) + the attention
  core at :attr:`Efficiency.attention`, the published speed of the attention kernel on the GPU
  (:mod:`pipewright.cost.attention_kernels`; flash attention skips the masked half of the causal
  square; eager attention's batched GEMMs run at the GEMM efficiency) +
  the memory-bound kernels' bytes / memory bandwidth + tensor-parallel communication (what
  ``tp_comm_overlap`` leaves exposed, :mod:`pipewright.cost.tp_overlap`) + the context-parallel
  exchange its implementation leaves exposed (:mod:`pipewright.cost.context_parallel`, ``cp_comm``) +
  FSDP's gathers beyond the compute they overlap (:mod:`pipewright.cost.sharding`). W carries GEMMs
  only.
- Memory-bound kernels (norms, activations, dropout, softmax, rotary, residual adds): the forward moves
  κ (:attr:`Efficiency.memory_traffic`) × the bytes a forward without recomputation stores; I moves
  twice that (plus a recomputed forward's); the output layer's fp32 softmax/cross-entropy moves 12
  bytes per logit in F and 10 in I (``kernels="fused"``; eager PyTorch: :mod:`pipewright.cost.kernels`).
- Tensor-parallel communication: two all-reduces of b·s·h elements per layer in F, two in I (two more
  with full recomputation); with sequence parallelism an all-gather plus a reduce-scatter replace each
  all-reduce (the same ring time). The vocabulary-parallel embedding all-reduces b·s·h in F, the
  vocabulary-parallel cross-entropy 3 × b·s fp32 values in F, the logit layer's input gradient b·s·h
  in I.
- Stage-boundary messages: b·s·h/c elements, / t with Megatron's scatter/gather (or sequence
  parallelism).
- Activation memory added by F per microbatch (:mod:`pipewright.cost.chunk_memory`): the layers'
  stored tensors (Korthikanti et al. 2022, generalised), the embedding dropout's mask on chunk 0, the
  final norm's and output layer's inputs and the loss's logits on the last chunk, and the chunk's
  output where the framework keeps it until its backward (``stage_outputs="kept"``; Megatron and
  Llama 3 free it after the send).
- Parameters: :func:`~pipewright.cost.layer.layer_parameters` per layer, the embedding (and GPT's
  position table) on chunk 0, the final norm and a V·h output layer on the last chunk; static memory
  (:mod:`pipewright.cost.chunk_memory`) = parameters / t × the per-parameter bytes of the optimizer
  sharding. REDUCE_GRAD sends ``grad_bytes`` per parameter, by default the reduction in the gradient
  buffer's dtype with the distributed optimizer's all-gather under the next forward (the planner's
  overlapped reduction; :func:`~pipewright.cost.sharding.reduction_bytes`, which ``model_setup`` applies
  to ``--grad-reduce``; nothing under FSDP without pipelining: per layer in the backward).
- ``dtype="fp8"``: the GEMMs run at the FP8 peak (Transformer Engine), attention, the memory-bound
  kernels, activations and messages stay bf16, except the four GEMM inputs a layer keeps for its
  backward, kept as FP8 copies (the fused attention kernel keeps its own bf16 output besides).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from pipewright.cost import sharding, tp_overlap
from pipewright.cost.attention_kernels import kernel_efficiency
from pipewright.cost.calibration import Calibration
from pipewright.cost.chunk_build import build_chunk
from pipewright.cost.chunk_memory import (
    check_stage_outputs,
    gather_buffer_bytes,
    held_buffer_bytes,
    layer_stored_bytes,
    rank_state,
    recompute_transient,
    transient_bytes,
)
from pipewright.cost.chunk_table import ChunkCosts as _Chunk
from pipewright.cost.comm import Mesh, TopologyComm, default_topology
from pipewright.cost.context_parallel import cp_buffer_bytes, cp_layer_seconds
from pipewright.cost.cost_inputs import ATTENTION, DTYPE_BYTES, RECOMPUTE, CostInputs
from pipewright.cost.dispatch import chunk_launched, optimizer_seconds
from pipewright.cost.efficiency import A100_EFFICIENCY, Efficiency, default_efficiency
from pipewright.cost.flop_count import logit_forward_flops, megatron_flops_per_iteration, megatron_parameters
from pipewright.cost.gemm import batched_attention_bytes, gemm_seconds, roofline
from pipewright.cost.kernels import check_kernels
from pipewright.cost.layer import (
    layer_forward_flops,
    layer_parameters,
)
from pipewright.cost.placement import layer_counts, roles
from pipewright.cost.run_fit import apply_fitted
from pipewright.cost.shape_scales import scales_of
from pipewright.cost.sharding import StateBytes, check_sharding, exposed, reduce_dtype_bytes, reduction_bytes
from pipewright.errors import ConfigError
from pipewright.hardware import Accelerator, accelerator
from pipewright.ir import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, STEP, Action, B, F, I, Schedule, W
from pipewright.models.layout import Layout
from pipewright.models.spec import ModelSpec
from pipewright.topology import Topology

_MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)
_KINDS = (F, B, I, W)
#: the per-layer fixed overhead τ of each pass, in units of τ (Efficiency.layer_overhead)
_OVERHEAD = {F: 1.0, I: 1.5, W: 0.5, B: 2.0}

__all__ = ["A100_EFFICIENCY", "ATTENTION", "DTYPE_BYTES", "RECOMPUTE", "Efficiency", "TransformerCost"]
__all__ += ["default_topology", "layer_forward_flops", "layer_parameters", "logit_forward_flops"]
__all__ += ["megatron_flops_per_iteration", "megatron_parameters"]


@dataclass(frozen=True, eq=False)
class TransformerCost:
    """Analytical :class:`~pipewright.cost.base.CostModel` (formulas: module docstring).

    ``layout``: layers per chunk (length = the schedule's number of stages), or a
    :class:`~pipewright.models.layout.Layout`, which also says which stages hold the embedding and the
    output layer with its loss (:mod:`pipewright.cost.placement`); ``None`` = uniform.
    ``topology``/``mesh``: where ranks run (:class:`~pipewright.cost.comm.Mesh` order); without a
    topology, :func:`default_topology` of ``gpu``. ``extra_times``: seconds of extension compute kinds
    (e.g. K-FAC tasks), 0 when absent. ``attention``: ``eager`` (the class default; the attention
    scores are stored) or ``flash`` (fused attention; ``pipewright simulate``'s default).
    ``recompute``: none, selective or full. ``cp``: context-parallel size (the mesh's cp when it has
    one); ``cp_comm``: how its attention exchanges K/V (:mod:`pipewright.cost.cp_impls`).
    ``optimizer_sharding``: none, zero1 or fsdp. ``stage_outputs``: freed
    (Megatron's deallocation, the default) or kept until the backward (torch.distributed.pipelining;
    :mod:`pipewright.cost.chunk_memory`). ``checkpoint``: how full recomputation re-runs a layer.
    ``tp_comm_overlap``: how tensor-parallel communication hides behind the GEMMs
    (:mod:`pipewright.cost.tp_overlap`; True: ``te``). ``calibration``: measured GEMM throughput by
    shape and memory bandwidth (:mod:`pipewright.cost.calibration`).
    ``attention_kernel``: the fused attention kernel (fa2, fa3, cudnn;
    :mod:`pipewright.cost.attention_kernels`) whose published speed on ``gpu`` prices the flash
    attention core; None: ``efficiency``'s attention rate (the GPU's usual kernel's in
    :func:`default_efficiency`). ``efficiency``: None = each device's ``gpu``'s defaults without wave
    quantisation (:func:`default_efficiency`; ``model_setup``, the path of ``pipewright simulate``,
    passes them with it).
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
    efficiency: Efficiency | None = None
    layout: Sequence[int] | Layout | None = None
    bytes_per_param: float = 18.0
    grad_bytes: float | None = None  # per parameter of REDUCE_GRAD; None: sharding.reduction_bytes
    extra_times: Mapping[str, float] = field(default_factory=dict)
    attention: str = "eager"
    cp: int = 1
    optimizer_sharding: str = "none"
    tp_comm_overlap: bool | str = False  # a cost.tp_overlap mode; True: te
    calibration: Calibration | None = None
    attention_kernel: str | None = None
    grad_dtype: str = "fp32"
    kernels: str = "fused"
    fsdp_grad_sync: str = "microbatch"
    stage_outputs: str = "freed"
    cp_comm: str = "transformer-engine"  # a cost.cp_impls implementation (--cp-comm)
    checkpoint: str = "reentrant"  # full recomputation's re-run: a whole layer, or "non-reentrant"
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
        check_sharding(self.optimizer_sharding, self.grad_dtype)
        tp_overlap.resolve(self.tp_comm_overlap)
        if self.grad_bytes is None:
            reduced = reduction_bytes(self.optimizer_sharding, self.grad_dtype, self.dtype, True)
            object.__setattr__(self, "grad_bytes", reduced)
        check_kernels(self.kernels)
        check_stage_outputs(self.stage_outputs)
        if self.checkpoint not in ("reentrant", "non-reentrant"):
            raise ConfigError(f"checkpoint must be reentrant or non-reentrant (got {self.checkpoint!r})")
        mesh = self.mesh
        if self.cp != mesh.cp:
            if mesh.cp != 1 and self.cp != 1:
                raise ConfigError(f"cp {self.cp} differs from the mesh's cp {mesh.cp}")
            mesh = replace(mesh, cp=max(self.cp, mesh.cp))
            object.__setattr__(self, "mesh", mesh)
            object.__setattr__(self, "cp", mesh.cp)
        from pipewright.cost.context_parallel import check_context_parallel

        check_context_parallel(self.spec, self.cp, self.cp_comm)
        topology = self.topology or default_topology(self.gpu, mesh.size)
        object.__setattr__(self, "topology", topology)
        if self.efficiency is None:
            defaults = default_efficiency(accelerator(self.gpu))
            object.__setattr__(self, "efficiency", replace(defaults, waves=False))
        if self.calibration is not None:  # `pipewright calibrate`'s constants, where it holds them
            object.__setattr__(self, "efficiency", apply_fitted(self.efficiency, self.calibration, self.gpu))
        if self.attention_kernel is not None:
            rate = kernel_efficiency(self.gpu, self.attention_kernel)
            if rate is not None:
                object.__setattr__(self, "efficiency", replace(self.efficiency, attention=rate))
        object.__setattr__(self, "comm", TopologyComm(topology, mesh, self.efficiency.comm))
        for rank in range(mesh.pp):
            acc = topology.accelerator(self.comm.device(rank))
            acc.peak(self.dtype)  # one-line error if it has none
            acc.peak(self.act_dtype)

    @property
    def attention_bytes(self) -> float:
        """Bytes per FLOP eager attention's batched GEMMs move (0 for the fused kernels, or without the
        shape model, ``efficiency.waves``; :func:`pipewright.cost.gemm.batched_attention_bytes`)."""
        if self.attention == "flash" or not self.efficiency.waves:
            return 0.0
        return batched_attention_bytes(self.spec, self.activation_bytes_per_element, self.cp)

    @property
    def act_dtype(self) -> str:
        """The dtype of activations, attention and memory-bound kernels: bf16 under fp8 GEMMs."""
        return "bf16" if self.dtype == "fp8" else self.dtype

    @property
    def activation_bytes_per_element(self) -> int:
        """Bytes of one activation element (:attr:`act_dtype`)."""
        return DTYPE_BYTES[self.act_dtype]

    @property
    def cost_inputs(self) -> CostInputs:
        """The values the memory formulas below this class read (:mod:`pipewright.cost.cost_inputs`)."""
        if "inputs" not in self._cache:
            self._cache["inputs"] = CostInputs(**{f.name: getattr(self, f.name) for f in fields(CostInputs)})
        return self._cache["inputs"]

    def efficiency_of(self, acc: Accelerator) -> Efficiency:
        """The efficiency on ``acc`` (one set per model: ``efficiency``, resolved from ``gpu``)."""
        return self.efficiency

    # -- per-chunk tables ---------------------------------------------------------------------------
    def layers_of(self, schedule: Schedule) -> tuple[int, ...]:
        return layer_counts(self.layout, self.spec.layers, schedule.num_stages)

    def _chunk(self, stage: int, schedule: Schedule) -> _Chunk:
        key = (stage, schedule.num_stages)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._build_chunk(stage, schedule.num_stages, self.layers_of(schedule))
        return hit

    def layer_stored_bytes(self, mode: str | None = None, fp8: bool | None = None) -> float:
        """Bytes one layer's forward stores per microbatch and device under recomputation ``mode``
        (default: this model's), before the context-parallel split; ``fp8``: GEMM inputs kept as FP8
        copies (default: with fp8 GEMMs). :func:`pipewright.cost.chunk_memory.layer_stored_bytes`."""
        return layer_stored_bytes(self.cost_inputs, mode, fp8)

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        """Chunk ``stage``'s table of ``num_stages`` holding ``layers`` (:func:`pipewright.cost.chunk_build.
        build_chunk`, with its ends priced apart where :meth:`_ends` builds them; subclasses extend it)."""
        chunk = build_chunk(self.cost_inputs, stage, num_stages, layers, self.checkpoint)
        ends = self._ends(stage, num_stages, layers) if chunk.layers and (chunk.first or chunk.last) else None
        return chunk if ends is None else replace(chunk, ends=ends)

    def _ends(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> tuple[_Chunk, ...] | None:
        """Chunk ``stage``'s embedding and head without its layers, each a piece of its own, where the
        host's launches are priced (each combined with its own launches: the embedding runs at the
        forward's start, the head at its end; :func:`pipewright.cost.dispatch.chunk_launched`) or a
        calibration's measured shape scales them apart (:mod:`pipewright.cost.shape_scales`)."""
        if self.efficiency.host_per_kernel <= 0 and scales_of(self) == (1.0, 1.0):
            return None
        if roles(self.layout, stage, num_stages) == (True, True):  # as the planner's pieces: stage 0 and
            alone = replace(self, layout=None) if self.layout is not None else self  # the last of two
            return alone._build_chunk(0, 2, (0, 0)), alone._build_chunk(1, 2, (0, 0))
        bare = tuple(0 if i == stage else x for i, x in enumerate(layers))
        return (self._build_chunk(stage, num_stages, bare),)

    # -- time ---------------------------------------------------------------------------------------
    def gemm_time(self, gemms, acc: Accelerator) -> float:
        """Seconds of ``gemms`` ((m, n, k, count) each) on ``acc`` (:func:`pipewright.cost.gemm.gemm_seconds`:
        a calibration's measured throughput by shape, else the base efficiency × wave quantisation)."""
        return gemm_seconds(gemms, acc, self.dtype, self.efficiency_of(acc), self.calibration)

    def kind_time(self, chunk: _Chunk, kind: str, rank: int) -> float:
        """Seconds of one ``kind`` action of ``chunk`` on pipeline rank ``rank`` (module docstring)."""
        return chunk_launched(self, chunk, kind, *self.gpu_time(chunk, kind, rank), rank)

    def gpu_time(self, chunk: _Chunk, kind: str, rank: int) -> tuple[float, float]:
        """(GPU seconds, of them exposed tensor-parallel collectives) of :meth:`kind_time`."""
        acc = self.topology.accelerator(self.comm.device(rank))
        eff = self.efficiency_of(acc)
        gemm = self.gemm_time(chunk.gemms[kind], acc)
        rate = eff.attention_rate if self.attention == "flash" else eff.gemm  # eager: batched GEMMs
        bandwidth = acc.memory_bandwidth
        if self.calibration is not None:
            bandwidth = self.calibration.memory_bandwidth
        attn = roofline(
            chunk.attention[kind], acc.peak(self.act_dtype) * rate, self.attention_bytes, bandwidth
        )
        memory = chunk.traffic[kind] / bandwidth
        tp = tp_overlap.tp_exposed_time(self, chunk, kind, rank, gemm)
        ring = 0.0
        if self.cp > 1 and chunk.layers:
            fwd = chunk.attention[F] / (acc.peak(self.act_dtype) * rate) / chunk.layers
            ring = chunk.layers * cp_layer_seconds(self, kind, rank, attn / chunk.layers, fwd, bandwidth)
        fsdp = 0.0
        if self.regathers and kind != W:
            fsdp = exposed(self._fsdp_comm(chunk, kind, rank), gemm + attn)
        overhead = chunk.layers * eff.layer_overhead * _OVERHEAD[kind]
        return gemm + attn + memory + tp + ring + fsdp + overhead, tp

    @property
    def regathers(self) -> bool:
        """FSDP re-gathers each layer's weights per microbatch (pp = 1); with pipelining the gathered
        weights stay for the step (Llama 3's and torchtitan's FSDP with pipeline parallelism): one
        all-gather and reduce-scatter per iteration, priced as REDUCE_GRAD."""
        return self.optimizer_sharding == "fsdp" and self.mesh.pp == 1

    def _fsdp_comm(self, chunk: _Chunk, kind: str, rank: int) -> float:
        """FSDP per microbatch: all-gather the chunk's 16-bit weights before F and before the backward,
        reduce-scatter its gradients in the reduce dtype after the backward (I/B)."""
        weights = chunk.params * 2.0
        t = self.comm.collective_time("all_gather", rank, weights, group="dp")
        if kind == F:
            return t
        return t + self.comm.collective_time(
            "reduce_scatter", rank, chunk.params * reduce_dtype_bytes(self.grad_dtype, self.dtype), group="dp"
        )

    # -- CostModel ----------------------------------------------------------------------------------
    def compute_time(self, action: Action, schedule: Schedule) -> float:
        kind = action.kind
        if not schedule.kinds[kind].compute:
            return 0.0
        if kind == STEP and action.microbatch is None:  # + its tensor-parallel and tied all-reduces
            r = schedule.rank_of(action.stage)
            tp = sum(
                self.comm.tp_all_reduce_time(r, b)
                for b in sharding.tp_step_bytes(self, action.stage, schedule)
            )
            return (
                optimizer_seconds(self, self._chunk(action.stage, schedule).params)
                + tp
                + self._tied(action.stage, schedule)
            )
        if kind not in (F, B, I, W):
            return float(self.extra_times.get(kind, 0.0))
        rank = schedule.rank_of(action.stage)
        key = ("time", action.stage, kind, schedule.num_stages, rank)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.kind_time(self._chunk(action.stage, schedule), kind, rank)
        return hit

    def _tied(self, stage: int, schedule: Schedule) -> float:
        """Seconds of ``stage``'s all-reduce of a tied embedding's gradient with the other end of the
        pipeline (:func:`~pipewright.cost.sharding.tied_step_bytes`; 0 where there is none)."""
        nbytes = sharding.tied_step_bytes(self, stage, schedule)
        if not nbytes:
            return 0.0
        ends = (schedule.rank_of(0), schedule.rank_of(schedule.num_stages - 1))
        return self.comm.collective_time("all_reduce", schedule.rank_of(stage), nbytes, "pp", ends)

    def message_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind in _MESSAGES:
            act = (
                self.spec.seq_len * self.microbatch * self.spec.hidden * DTYPE_BYTES[self.act_dtype] / self.cp
            )
            split = self.scatter_gather or self.sequence_parallel
            return act / self.mesh.tp if split else act
        if action.kind == REDUCE_GRAD:
            if self.regathers:
                return 0.0  # reduce-scattered per layer in the backward
            return sharding.like(
                self._chunk(action.stage, schedule).params * self.grad_bytes, self.grad_bytes
            )
        return 0.0

    def activation_bytes(self, action: Action, schedule: Schedule) -> float:
        if action.kind not in (F, B, I, W):
            return 0.0
        return self._chunk(action.stage, schedule).memory[action.kind]

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """Bytes a recomputing backward holds while it runs (:func:`chunk_memory.transient_bytes`) + a
        layer's context-parallel K/V buffers (:func:`~pipewright.cost.context_parallel.cp_buffer_bytes`)."""
        layers = self._chunk(action.stage, schedule).layers
        cp = cp_buffer_bytes(self, action.kind) if layers else 0.0
        layer = self.layer_transient() if layers and action.kind in (B, I) else 0.0
        return self.recompute_transient_bytes(action, schedule, layer) + cp

    def recompute_transient_bytes(self, action: Action, schedule: Schedule, layer: float) -> float:
        """:func:`chunk_memory.transient_bytes` of ``action`` with ``layer``, one layer's transient of
        the action's chunk (0 where it has no layers), and its rank's parameters for a STEP."""
        rank = schedule.rank_of(action.stage)
        params = self.rank_parameters(rank, schedule) if action.kind == STEP else 0.0
        return transient_bytes(self.cost_inputs, action, schedule, layer, params)

    def layer_transient(self) -> float:
        """One layer's recomputation transient per microbatch and device (chunk_memory)."""
        return recompute_transient(self.cost_inputs)

    def static_bytes(self, rank: int, schedule: Schedule) -> float:
        """State of ``rank``'s chunks (sharded as configured) and its held buffers (chunk_memory)."""
        params = self.rank_parameters(rank, schedule)
        return params * self.state().total + held_buffer_bytes(self.cost_inputs, rank, schedule)

    def rank_parameters(self, rank: int, schedule: Schedule) -> float:
        """Parameters per device of ``rank``'s chunks."""
        return sum(self._chunk(c, schedule).params for c in schedule.stages_of(rank))

    def state(self) -> StateBytes:
        """Bytes per parameter for weights, gradients and optimizer state on one rank (chunk_memory)."""
        return rank_state(self.cost_inputs)

    def gather_buffer_bytes(self) -> float:
        """FSDP's gathered weights of two layers when it re-gathers per microbatch; 0 otherwise."""
        return gather_buffer_bytes(self.cost_inputs)

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
