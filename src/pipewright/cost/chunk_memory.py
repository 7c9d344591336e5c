"""The memory side of the analytical cost model: what a chunk keeps per microbatch, and what a rank
holds for the whole step.

Activation bytes one chunk's forward adds per microbatch and device (s = sequence, b = microbatch,
h = hidden, V = vocabulary, t = tensor-parallel size, c = context-parallel size, e = bytes per
activation element; all terms / c):

- each of its n layers: :func:`~pipewright.cost.layer.layer_stored_units` × s·b·h (Korthikanti et al.
  2022, Table 2, generalised), 2·s·b·h·e/2 with full recomputation (/t with sequence parallelism);
  a layer implementation other than Megatron's (a Hugging Face family's modules) keeps its own set,
  :func:`~pipewright.cost.layer_activations.implementation_layer_bytes`.
  With FP8 GEMMs and a fused attention kernel the attention output is kept twice: in 16 bits by the
  kernel, whose backward needs it (Transformer Engine v1.8's ``FusedAttnFunc`` saves q, k, v and
  ``out``; FlashAttention does the same), and as the FP8 copy the output projection saves instead of
  its 16-bit input (TE's ``_Linear`` saves ``inputmat``/``inputmat_t``, the cast copy, not
  ``inputmat_no_fp8``): + 2·(output width)/h units /t over what the FP8 copy alone counts.
  PyTorch's tensor parallelism (torchtitan; ``kernels`` eager or compiled) with sequence
  parallelism saves the attention's and the MLP's inputs all-gathered: ``PrepareModuleInput``
  redistributes the norm's sequence-sharded output to ``Replicate()`` once per module and the
  column-parallel linears save that tensor (torchtitan ``parallelize_llama.py``), where Megatron
  saves the s·b·h/t shard and re-gathers it in the backward: + 2 × 2·(1 − 1/t) units (1 byte per
  element under FP8) unless the layer is fully recomputed (:func:`gathered_input_units`).
- the embedding (chunk 0): its output is the first layer's input, already counted there, or, in an
  embedding-only chunk, the chunk's output (below); the dropout after it keeps a one-byte mask,
  s·b·h bytes, /t with sequence parallelism (Megatron scatters the embedding to the sequence-parallel
  region before the dropout; Korthikanti et al. §4.3: s·b·h·p/t over p microbatches in flight, and the
  "s·b·h·p spike on pipeline rank 0" of their Appendix B). Families without dropout keep nothing.
- the chunk's output, on every chunk but the last (``stage_outputs``): ``freed`` — Megatron
  deallocates each microbatch's output after sending it, keeping only its autograd node
  (``deallocate_output_tensor``, on by default; Korthikanti et al. Appendix B: "we save s·b·h·r
  memory per pipeline rank" with r microbatches in flight), and Llama 3 "proactively deallocate[s]
  ... the input and output tensors of each pipeline stage" (§3.3.2): nothing is kept beyond the
  layers' own tensors. ``kept`` — ``torch.distributed.pipelining`` (torchtitan) keeps each
  microbatch's ``output_tuple`` in the stage's ``fwd_cache`` until its backward pops it (stage.py,
  ``forward_one_chunk``), and so does pipewright's runtime (``RunState.stage_outputs``): s·b·h·e,
  /t with sequence parallelism (the output is sequence-sharded). ``step`` — what
  ``torch.distributed.pipelining`` (torch 2.6, torchtitan's) holds besides: ``forward_one_chunk``
  also appends every output to ``output_chunks`` ("for final output merge or reduction"), cleared
  only by ``clear_runtime_states`` at the next step, so B does not free it and the m outputs of a
  step accumulate; on the last chunk of a pipeline that output is the logits, 2·b·s·V/t bytes
  (16-bit, vocabulary-sharded by the loss-parallel output layer). And ``PipelineStage``
  allocates a receive buffer per microbatch for the step before the first forward
  (``_prepare_forward_infra``, eagerly for every microbatch; the gradients'
  in ``_prepare_backward_infra``/``_create_grad_recv_info``): m × s·b·h·e (/t, /c) for the input of
  every chunk but the first and m × the same for the output gradient of every chunk but the last,
  held as static memory (:func:`pipeline_buffer_bytes`). The received input is the first layer's
  input, which its checkpoint saves without a copy, so the chunk's F adds one s·b·h·e less.
- the last chunk: the final norm's input and the output layer's input, s·b·h·e each (/t with
  sequence parallelism; Korthikanti et al. §4.3: 2·s·b·h/t + 2·s·b·h/t; Megatron saves the
  sequence-sharded input and re-gathers it in the backward). PyTorch's tensor parallelism
  (torchtitan; ``kernels`` eager or compiled) keeps the output layer's input whole: its
  ``ColwiseParallel(input_layouts=Shard(1))`` all-gathers the sequence to ``Replicate()`` before
  the linear, whose autograd saves what it multiplied (torchtitan ``parallelize_llama.py`` l. 138),
  s·b·h·e. And the loss's kept logits
  (:func:`~pipewright.cost.kernels.loss_bytes`, per b·s·V/t; PyTorch's loss-parallel kernel where
  t > 1 and the loss is not fused).

W frees the inputs of the linear layers (:func:`deferred_input_bytes`, (3h + f)·s·b·e a layer without
tensor parallelism; nothing with full recomputation), I the rest, B everything (Zero Bubble's
accounting); I adds, and W frees, the output gradients of the linear layers it hands to the W store
(:func:`deferred_grad_output_bytes`).

The recomputation transient (:func:`recompute_transient`): a layer whose forward kept less than all
its activations re-runs the dropped part at the start of its backward, and for that layer's backward
the recomputed tensors are live on top of everything stored. Megatron-LM's ``CheckpointFunction``
(``tensor_parallel.checkpoint``, one layer per call with ``--recompute-num-layers 1``) and PyTorch's
non-reentrant ``torch.utils.checkpoint`` (torchtitan wraps each ``TransformerBlock``) both re-run one
block's forward from its saved input, whose tensor the recomputed forward saves again without a copy:
the transient is one layer's activations without recomputation less what the layer kept,
(stored_none − stored_mode)/c per device — with full recomputation the whole layer less its input
(Korthikanti et al. Table 2: s·b·h·(34/t + 5·a·s/(h·t)) − 2·s·b·h/t with sequence parallelism),
with selective recomputation the attention core's 5·a·s²·b/t (eager attention; none with flash
attention), with torchtitan's operator-level policy the operators it re-runs
(:mod:`pipewright.cost.op_recompute`). It is a property of the actions that re-run the forward
(B, or I when the backward is split; W re-runs nothing) of chunks with layers; the simulator's
peak is the highest over actions of (live before the action + its transient). A mixture of experts'
layer re-creates its expert activations too (:meth:`~pipewright.cost.moe_cost.MoECost.moe_layer_transient`).
Megatron's ``--recompute-method``/``--recompute-num-layers`` (groups of N layers per checkpoint, or
the first N layers only): :mod:`pipewright.cost.partial_recompute`. The backward's own gradient
buffers are not priced.

Static memory per rank: parameters / t × the per-parameter bytes of the optimizer sharding
(:func:`~pipewright.cost.sharding.state_bytes`), FSDP's gathered weights of two layers and of the
root group (:func:`gather_buffer_bytes`) when it re-gathers per microbatch, and the pipeline's
receive buffers (:func:`pipeline_buffer_bytes`).
"""

from __future__ import annotations

from typing import Any

from pipewright.cost.attention_kinds import attention_of
from pipewright.cost.cost_inputs import CostInputs
from pipewright.cost.kernels import loss_bytes
from pipewright.cost.layer import (
    edge_parameters,
    has_dropout,
    layer_gemms,
    layer_parameters,
    layer_stored_units,
)
from pipewright.cost.layer_activations import implementation_layer_bytes
from pipewright.cost.placement import roles
from pipewright.cost.sharding import (
    GRAD_BYTES,
    GRAD_DTYPE_BYTES,
    WEIGHT_BYTES,
    StateBytes,
    pipelined_fsdp_state,
    state_bytes,
)
from pipewright.errors import ConfigError
from pipewright.ir import STEP, B, F, I, W

#: what a pipeline stage does with each microbatch's output once it is sent (module docstring)
STAGE_OUTPUTS = ("freed", "kept", "step")


def check_stage_outputs(mode: str) -> None:
    """One-line error for an unknown ``--stage-outputs``."""
    if mode not in STAGE_OUTPUTS:
        raise ConfigError(f"--stage-outputs must be one of {', '.join(STAGE_OUTPUTS)} (got {mode!r})")


def fused_output_units(spec: Any, t: int) -> float:
    """16-bit units of s·b·h the fused attention kernel keeps of its output beyond the output
    projection's FP8 copy: 2 × the projection's input width / h, / t (module docstring)."""
    width = attention_of(spec).gemms(spec, 1.0, 1)[-1][2]
    return 2 * width / spec.hidden / t


def gathered_input_units(t: int, fp8: bool) -> float:
    """Units of s·b·h PyTorch's tensor parallelism keeps beyond Megatron's sequence-parallel count:
    the attention's and the MLP's inputs whole instead of /t (module docstring)."""
    return (1 if fp8 else 2) * 2 * (1 - 1 / t)


def layer_stored_bytes(cost: CostInputs, mode: str | None = None, fp8: bool | None = None) -> float:
    """Bytes one layer's forward stores per microbatch and device under recomputation ``mode``
    (default: the cost model's), before the context-parallel split; ``fp8``: GEMM inputs kept as FP8
    copies (default: with fp8 GEMMs)."""
    spec, b, t = cost.spec, cost.microbatch, cost.mesh.tp
    mode = mode or cost.recompute
    sbh = spec.seq_len * b * spec.hidden
    scale = cost.activation_bytes_per_element / 2
    implemented = implementation_layer_bytes(spec, b, cost.activation_bytes_per_element, t, mode)
    if implemented is not None:  # a Hugging Face family's modules (cost/layer_activations.py)
        return implemented
    if mode == "full":
        return 2 * sbh * scale / (t if cost.sequence_parallel else 1)
    scores = cost.attention == "eager" and mode == "none"
    fp8 = cost.dtype == "fp8" if fp8 is None else fp8
    units = layer_stored_units(spec, t, cost.sequence_parallel, scores, fp8)
    if fp8 and cost.attention == "flash":
        units += fused_output_units(spec, t)
    return sbh * units * scale


def stored_memory_bytes(cost: CostInputs, mode: str | None = None) -> float:
    """:func:`layer_stored_bytes` (Korthikanti et al.'s count, which the memory-bound traffic also
    reads) + what PyTorch's tensor parallelism keeps all-gathered besides
    (:func:`gathered_input_units`; not under full recomputation): the bytes one layer holds for its
    backward, per microbatch and device, before the context-parallel split."""
    mode = mode or cost.recompute
    stored = layer_stored_bytes(cost, mode)
    t = cost.mesh.tp
    if mode == "full" or t == 1 or not cost.sequence_parallel or cost.kernels == "fused":
        return stored
    units = gathered_input_units(t, cost.dtype == "fp8")
    return (
        stored
        + cost.spec.seq_len
        * cost.microbatch
        * cost.spec.hidden
        * units
        * cost.activation_bytes_per_element
        / 2
    )


def recompute_transient(cost: CostInputs, kept: float | None = None) -> float:
    """Bytes one layer's recomputation holds on top of what its forward kept, per microbatch and device
    (module docstring): (stored_none − ``kept``)/c, ``kept`` defaulting to the layer's stored bytes
    under the cost model's mode; 0 without recomputation."""
    kept = stored_memory_bytes(cost) if kept is None else kept
    return max(stored_memory_bytes(cost, "none") - kept, 0.0) / cost.cp


def transient_bytes(
    cost: CostInputs, action: Any, schedule: Any, layer: float, rank_params: float = 0.0
) -> float:
    """The recomputation transient of ``action`` on top of the live bytes before it: ``layer`` (the
    cost model's ``layer_transient()``, :func:`recompute_transient` of its mode, where the action's
    chunk has layers; 0 where it has none) for B and I, 0 for every other action. On the last chunk
    the backward first runs the loss and the output layer, freeing what they kept
    (:func:`output_kept_bytes`) before any layer is recomputed: max(0, transient − that). A STEP:
    :func:`step_transient_bytes` of ``rank_params``, the parameters of the action's rank."""
    if action.kind == STEP:
        return step_transient_bytes(cost, rank_params)
    loss = loss_transient_bytes(cost, action, schedule)
    if action.kind not in (B, I) or not layer:
        return loss
    transient = layer
    if roles(cost.layout, action.stage, schedule.num_stages)[1]:
        transient = max(transient - output_kept_bytes(cost), 0.0)
    return max(transient, loss)


def step_transient_bytes(cost: CostInputs, rank_params: float) -> float:
    """The optimizer step's fp32 gradients, on top of the static bytes, when the gradients are kept in
    16 bits (``grad_dtype``): the step makes an fp32 copy of every gradient for the fp32 masters
    (Megatron's ``main_param.grad = main_grad.float()``, pipewright's ``MasterOptimizer.step``), of its
    own slice under ZeRO-1 or FSDP — 4 bytes a parameter of the rank's chunks (one step over them all)
    / the replicas sharding it (``rank_params``: the parameters of the rank's chunks). 0 with fp32
    gradients (the optimizer steps on them) or without STEP."""
    if GRAD_DTYPE_BYTES[cost.grad_dtype] >= GRAD_BYTES:
        return 0.0
    shards = 1 if cost.optimizer_sharding == "none" else cost.mesh.dp * cost.cp
    return rank_params * GRAD_BYTES / shards


#: bytes per logit the fused (Megatron) cross-entropy holds for a moment beside its kept fp32 copy:
#: the 16-bit logits while the forward makes that copy, the 16-bit input gradient the backward casts
LOSS_CAST_BYTES = 2.0


def loss_transient_bytes(cost: CostInputs, action: Any, schedule: Any) -> float:
    """The loss's moment in the backward (B or I) of the last chunk, on top of the live bytes before
    it, with the fused cross-entropy (kept: one fp32 copy of the logits,
    :func:`~pipewright.cost.kernels.loss_bytes`): the 16-bit input gradient cast from the fp32 one
    (Megatron's ``VocabParallelCrossEntropy`` and :mod:`pipewright.models.cross_entropy` alike),
    :data:`LOSS_CAST_BYTES` · b·s·V/t/c. The forward's moment (the 16-bit logits beside the fp32 copy)
    is as large and comes with less live: the chunk's B follows its F with the same microbatches in
    flight. The eager kernels' counts already hold their peak; 0 there and on every other chunk."""
    if cost.kernels != "fused" or action.kind not in (B, I):
        return 0.0
    if not roles(cost.layout, action.stage, schedule.num_stages)[1]:
        return 0.0
    return LOSS_CAST_BYTES * cost.microbatch * cost.spec.seq_len * cost.spec.vocab / cost.mesh.tp / cost.cp


def embedding_kept_bytes(cost: CostInputs) -> float:
    """The embedding dropout's one-byte mask per microbatch and device (module docstring)."""
    if not has_dropout(cost.spec):
        return 0.0
    sbh = cost.spec.seq_len * cost.microbatch * cost.spec.hidden
    return sbh / (cost.mesh.tp if cost.sequence_parallel else 1) / cost.cp


def head_kept_bytes(cost: CostInputs) -> float:
    """The final norm's and the output layer's inputs the last chunk keeps per microbatch and device
    (module docstring); PyTorch's tensor parallelism (``kernels`` eager or compiled) keeps the output
    layer's input all-gathered."""
    sbh = cost.spec.seq_len * cost.microbatch * cost.spec.hidden
    split = cost.mesh.tp if cost.sequence_parallel else 1
    gathered = 1 if cost.kernels != "fused" else split
    return (1 / split + 1 / gathered) * sbh * cost.activation_bytes_per_element / cost.cp


def output_kept_bytes(cost: CostInputs) -> float:
    """What the last chunk keeps per microbatch and device for the loss and the output layer:
    :func:`head_kept_bytes` + the loss's kept bytes per logit × b·s·V/t/c
    (:func:`~pipewright.cost.kernels.loss_bytes`)."""
    spec, t = cost.spec, cost.mesh.tp
    loss_parallel = t > 1 and cost.kernels != "fused"
    logits = cost.microbatch * spec.seq_len * spec.vocab / t / cost.cp
    return head_kept_bytes(cost) + loss_bytes(cost.kernels, loss_parallel)[1] * logits


def boundary_bytes(cost: CostInputs) -> float:
    """One microbatch's activation at a stage boundary, per device: s·b·h·e (/t with sequence
    parallelism, /c)."""
    sbh = cost.spec.seq_len * cost.microbatch * cost.spec.hidden
    split = cost.mesh.tp if cost.sequence_parallel else 1
    return sbh * cost.activation_bytes_per_element / split / cost.cp


def stage_output_bytes(cost: CostInputs) -> float:
    """A chunk's output kept until its backward (``stage_outputs`` ``kept`` or ``step``), per
    microbatch and device; 0 when it is freed after the send (module docstring)."""
    return 0.0 if cost.stage_outputs == "freed" else boundary_bytes(cost)


def pipeline_buffer_bytes(cost: CostInputs, rank: int, schedule: Any) -> float:
    """``stage_outputs="step"``: the receive buffers ``PipelineStage`` allocates for every microbatch
    of the step on ``rank`` — the input of each of its chunks but stage 0's, the output gradient of
    each but the last stage's (module docstring); 0 otherwise."""
    if cost.stage_outputs != "step" or schedule.num_stages < 2:
        return 0.0
    ends = sum((s > 0) + (s < schedule.num_stages - 1) for s in schedule.stages_of(rank))
    return ends * schedule.num_microbatches * boundary_bytes(cost)


def chunk_memory(cost: CostInputs, n: int, first: bool, last: bool) -> dict[str, float]:
    """Activation bytes per kind (F adds, W/I/B free) of a chunk of ``n`` layers, per microbatch and
    device; ``first``/``last``: it holds the embedding / the output layer and loss."""
    spec, b, t, c = cost.spec, cost.microbatch, cost.mesh.tp, cost.cp
    s, V = spec.seq_len, spec.vocab
    per_layer = stored_memory_bytes(cost) / c
    full = cost.recompute == "full"
    w_frees = 0.0 if full else min(deferred_input_bytes(cost), per_layer)
    added = n * per_layer
    step = cost.stage_outputs == "step"
    held = 0.0  # kept until the step ends (``output_chunks``)
    if first:
        added += embedding_kept_bytes(cost)
    elif step:
        added -= boundary_bytes(cost)  # the first layer's input is the receive buffer
    if last:
        added += output_kept_bytes(cost)
        if step and not first:
            held = 2 * b * s * V / t / c
    else:
        held = stage_output_bytes(cost) if step else 0.0
        added += stage_output_bytes(cost) - held
    added += held
    kept = added - held
    gout = deferred_grad_output_bytes(cost, n, last)
    return {F: added, B: -kept, W: -n * w_frees - gout, I: -(kept - n * w_frees) + gout}


def deferred_input_bytes(cost: CostInputs) -> float:
    """The inputs of one layer's linear layers that a split backward's W store keeps from I to W, per
    microbatch and device: Σ m·k over the layer's forward GEMMs (m tokens, k inputs per device; the
    fused q/k/v and gate/up GEMMs read one tensor each; under sequence parallelism a column-parallel
    layer's 1/t chunk), × e — (3h + f)·s·b·e for a Llama or GPT layer without tensor parallelism.
    What else the layer stored, I frees."""
    spec, t = cost.spec, cost.mesh.tp
    tokens = cost.microbatch * spec.seq_len / cost.cp
    # with sequence parallelism Megatron's column-parallel layers (those reading the full hidden
    # width) keep their input's 1/t sequence chunk and gather it again for W
    chunked = t > 1 and cost.sequence_parallel and cost.kernels == "fused"
    gemms = layer_gemms(spec, tokens, t)
    inputs = sum(m * k / (t if chunked and k == spec.hidden else 1) for m, _, k in gemms)
    return inputs * cost.activation_bytes_per_element


def deferred_grad_output_bytes(cost: CostInputs, n: int, last: bool) -> float:
    """What a split backward's I hands the W store besides the kept inputs, per microbatch and device:
    the output gradient ∂L/∂y of every linear layer whose weight gradient W computes (Zero Bubble's
    W needs (x, ∂L/∂y) of each; pipewright's ``WeightGradStore`` and Megatron's ZB store both hold
    them from I to W) — Σ m·n over the chunk's forward GEMMs (m tokens, n outputs per device: the
    row-parallel layers' whole-sequence gradient under sequence parallelism), with the logit layer's
    b·s·V/t on the last chunk, × e."""
    spec, esize = cost.spec, cost.activation_bytes_per_element
    tokens = cost.microbatch * spec.seq_len / cost.cp
    elements = n * sum(g[0] * g[1] for g in layer_gemms(spec, tokens, cost.mesh.tp)) if n else 0.0
    if last and spec.vocab:
        elements += tokens * spec.vocab / cost.mesh.tp
    return elements * esize


def weight_element_bytes(cost: CostInputs) -> float:
    """Bytes of one weight the model computes with: 2 (16-bit weights, fp32 masters in the optimizer;
    fp8 GEMMs keep 16-bit weights too), 4 when training in fp32 (the activations' dtype is the
    weights' but under fp8)."""
    return max(WEIGHT_BYTES, cost.activation_bytes_per_element)


def rank_state(cost: CostInputs) -> StateBytes:
    """Bytes per parameter for weights, gradients and optimizer state on one rank (with pipelined
    FSDP the 16-bit weights stay gathered for the step)."""
    state = state_bytes(
        cost.optimizer_sharding,
        cost.mesh.dp * cost.cp,
        cost.bytes_per_param,
        cost.grad_dtype,
        weight_element_bytes(cost),
    )
    if cost.optimizer_sharding == "fsdp" and not cost.regathers:
        state = pipelined_fsdp_state(state, cost.fsdp_grad_sync, cost.grad_dtype)
    return state


def gather_buffer_bytes(cost: CostInputs) -> float:
    """FSDP re-gathering per layer: the 16-bit weights of two gathered layers (computing +
    prefetched), and of the root group — the embedding, final norm and output layer (one table tied),
    which the
    outermost ``fully_shard(model)`` holds (torchtitan's ``apply_fsdp``) and PyTorch's FSDP does not
    reshard after the forward, "since for training, the parameters would be freed and all-gathered
    immediately" (FSDP2 ``FSDPState._lazy_init`` sets the root's ``post_forward_mesh_info = None``;
    FSDP1's ``_post_forward_reshard`` skips the root too): held from the forward to the end of the
    backward. 0 otherwise."""
    if not cost.regathers:
        return 0.0
    spec, t = cost.spec, cost.mesh.tp
    root = edge_parameters(spec, t, True, True)
    return (2 * layer_parameters(spec) / t + root) * WEIGHT_BYTES


def held_buffer_bytes(cost: CostInputs, rank: int, schedule: Any) -> float:
    """Buffers ``rank`` holds beside its state: FSDP's gathered weights
    (:func:`gather_buffer_bytes`) and the pipeline's receive buffers (:func:`pipeline_buffer_bytes`)."""
    return gather_buffer_bytes(cost) + pipeline_buffer_bytes(cost, rank, schedule)
