"""The per-chunk tables of a :class:`~pipewright.cost.transformer.TransformerCost`: FLOPs (model and
executed), GEMM shapes, attention-core FLOPs, tensor-parallel bytes, memory-bound bytes, stored
activations, parameters and context-parallel ring bytes of one chunk per microbatch and device, by the
formulas of :mod:`pipewright.cost.transformer`'s module docstring."""

from __future__ import annotations

from types import MappingProxyType

from pipewright.cost import tp_overlap
from pipewright.cost.chunk_memory import chunk_memory, layer_stored_bytes
from pipewright.cost.chunk_table import ChunkCosts
from pipewright.cost.context_parallel import ring_bytes_per_layer
from pipewright.cost.cost_inputs import DTYPE_BYTES, CostInputs
from pipewright.cost.flop_count import logit_forward_flops
from pipewright.cost.kernels import cost_loss_bytes, layer_traffic
from pipewright.cost.layer import (
    attention_flops,
    edge_parameters,
    gemm_flops,
    layer_gemms,
    layer_linear_flops,
    layer_parameters,
    layer_recomputed_gemms,
)
from pipewright.cost.placement import roles
from pipewright.ir import B, F, I, W


def build_chunk(
    inputs: CostInputs, stage: int, num_stages: int, layers: tuple[int, ...], checkpoint: str = "reentrant"
) -> ChunkCosts:
    """The table of chunk ``stage`` of ``num_stages`` holding ``layers[stage]`` layers (and the
    embedding or the head by its role) under a cost model's inputs (its model, mesh, recomputation and
    kernels); ``checkpoint``: full recomputation's re-run (a whole layer, or "non-reentrant": without
    its last GEMM). Its ``ends`` are the cost model's to add."""
    spec, b, t, c = inputs.spec, inputs.microbatch, inputs.mesh.tp, inputs.cp
    s, h, V = spec.seq_len, spec.hidden, spec.vocab
    n = layers[stage]
    first, last = roles(inputs.layout, stage, num_stages)
    full, selective = inputs.recompute == "full", inputs.recompute == "selective"
    flash = inputs.attention == "flash"
    esize = DTYPE_BYTES[inputs.act_dtype]
    lin, attn = n * layer_linear_flops(spec, b), n * attention_flops(spec, b)
    logit = logit_forward_flops(spec, b) if last else 0.0
    model = {F: lin + attn + logit, I: lin + 2 * attn + logit, W: lin + logit}
    # selective re-runs the core under flash too (Megatron's checkpoint_core_attention, the runtime's)
    redo_attn = attn * ((1 if full or selective else 0) + (0.5 if flash else 0))
    own = 0.0 if full else n * gemm_flops(layer_recomputed_gemms(spec, b * s))  # the kind's (MLA)
    tail = n * gemm_flops(layer_gemms(spec, b * s)[-1:]) if checkpoint != "reentrant" else 0.0
    redo = (lin - tail if full else own) + redo_attn
    executed = {F: model[F], I: model[I] + redo, W: model[W]}
    causal = 0.5 if flash else 1.0  # fused kernels skip the masked half of the causal square
    attention = {F: attn * causal, I: (2 * attn + redo_attn) * causal, W: 0.0}
    tokens = b * s / c
    layer_fwd = [(m, nn, k, n) for m, nn, k in layer_gemms(spec, tokens, t)] if n else []
    fwd_gemms = layer_fwd + ([(tokens, V / t, h, 1)] if last and V else [])
    dgrad = [(m, k, nn, cnt) for m, nn, k, cnt in fwd_gemms]
    wgrad = [(nn, k, m, cnt) for m, nn, k, cnt in fwd_gemms]
    if full:  # the recomputed forward (not of the logit layer, as in Megatron; without its last GEMM
        dgrad += layer_fwd[: len(layer_fwd) - (tail > 0)]  # when the checkpoint stops early)
    elif n:  # what the attention kind recomputes itself (MLA's up-projections)
        dgrad += [(m, nn, k, n) for m, nn, k in layer_recomputed_gemms(spec, tokens, t)]
    gemms = {F: tuple(fwd_gemms), I: tuple(dgrad), W: tuple(wgrad)}
    act = s * b * h * esize / c  # one b·s·h activation tensor
    tp_bytes = tp_overlap.chunk_tp_bytes(
        act, n, full, first, last, 4.0 * b * s / c, inputs.sequence_parallel and t > 1
    )
    # memory-bound kernels: κ × the bytes a forward without recomputation stores
    stored = layer_stored_bytes(inputs, "none", fp8=False)
    fwd_traffic, bwd_traffic = (n * x / c for x in layer_traffic(inputs, esize, stored))
    redo_traffic = fwd_traffic if full else 0.0
    if selective and not flash:
        kept = layer_stored_bytes(inputs, "selective", fp8=False)
        redo_traffic = fwd_traffic - inputs.efficiency.memory_traffic * n * kept / c
    traffic = {F: fwd_traffic, I: bwd_traffic + redo_traffic, W: 0.0}
    if last:
        loss_moved = cost_loss_bytes(inputs)
        for kind in traffic:
            traffic[kind] += loss_moved[kind] * b * s * V / t / c
    memory = chunk_memory(inputs, n, first, last)
    params = n * layer_parameters(spec) / t + edge_parameters(spec, t, first, last)
    for table in (model, executed, traffic, attention):
        table[B] = table[I] + table[W]
    tp_bytes[B] = tp_bytes[I] + tp_bytes[W]
    gemms[B] = gemms[I] + gemms[W]
    ring = ring_bytes_per_layer(spec, b, c, t, esize)
    return ChunkCosts(
        MappingProxyType({k: v / t / c for k, v in executed.items()}),
        MappingProxyType({k: v / t / c for k, v in model.items()}),
        MappingProxyType(tp_bytes),
        MappingProxyType(traffic),
        MappingProxyType(memory),
        params,
        MappingProxyType(gemms),
        MappingProxyType({k: v / t / c for k, v in attention.items()}),
        MappingProxyType(ring),
        n,
        first=first,
        last=last,
    )
