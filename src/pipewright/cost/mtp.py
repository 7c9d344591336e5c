"""Multi-token prediction (MTP; DeepSeek-V3, arXiv 2412.19437, §2.2) in the cost model.

DeepSeek-V3 trains D = ``spec.mtp_depth`` = 1 extra module that predicts the token after next. Module k
takes the main model's last hidden state h_i and the embedding of token i + k, normalises both (RMSNorm),
projects their concatenation back to width h (M_k ∈ ℝ^{h×2h}), runs one transformer block and the
shared output head, and adds its cross-entropy loss (weight λ) to the main one. The embedding and the
output head are the main model's (no parameters of their own); the block is a layer of the model's
kind (DeepSeek-V3's MTP block is a MoE layer: the same layer as the model's last one). It sits with the
output layer, on the last chunk (in DualPipe's V shape that chunk and the embedding's are on one rank).

Priced on the last chunk, per microbatch of b sequences (tensor-parallel size t, context-parallel c):

- the D blocks as D more layers of the chunk (every term of :mod:`pipewright.cost.transformer` and, for
  a MoE model, :mod:`pipewright.cost.moe_cost`: GEMMs, attention, experts, all-to-alls, stored
  activations, parameters);
- per module, the projection GEMM T × h/t × 2h (T = b·s/c tokens; 2·b·s·h·2h FLOPs forward) and its
  input-gradient and weight-gradient GEMMs; the output layer's GEMM T × V/t × h again with both
  gradients (2·b·s·h·V each), its fp32 softmax/cross-entropy traffic and the vocabulary-parallel
  cross-entropy's three all-reduces of b·s fp32 values (F); under tensor parallelism the collectives
  Megatron-Core's ``MultiTokenPredictionLayer`` issues (:func:`~pipewright.cost.tp_overlap.mtp_tp_bytes`:
  the embedding's, the projection's, the gather of its output columns, the output layer's; with
  sequence parallelism the projection's and the output layer's re-gathers for their weight
  gradients, each hidden behind its input-gradient GEMM as the main head's re-gather is), and at the
  step the sequence-parallel gradients of its three norms
  (:func:`~pipewright.cost.layer.replicated_parameters`);
- stored for the backward per module: the two norm inputs and the projection input, 8·s·b·h bytes,
  and the fp32 logits 4·b·s·V/t bytes, all freed by I (or B);
- parameters per module: M_k (2h²/t) and three RMSNorm gains (3h).

The runtime builds no MTP module (``train`` trains the model with ``mtp_depth`` 0), so ``train
--dry-run --measure`` compares none: the tensor-parallel collectives are Megatron-Core 0.16's
(``megatron/core/transformer/multi_token_prediction.py``), read from its source.

Not priced: a copy of the V·h embedding on the last rank where a schedule puts the first and last
chunks on different ranks (Megatron-Core keeps one there as for tied embeddings; DualPipe needs none).
"""

from __future__ import annotations

from functools import cache
from types import MappingProxyType

from pipewright.cost.kernels import loss_bytes
from pipewright.cost.placement import roles
from pipewright.cost.tp_overlap import mtp_tp_bytes
from pipewright.cost.transformer import DTYPE_BYTES, TransformerCost, _Chunk
from pipewright.ir import B, F, I, W

_KINDS = (F, I, W)


class MultiTokenPrediction(TransformerCost):
    """Adds ``spec.mtp_depth`` prediction modules to the last chunk (module docstring). A mixin: the
    cost class of a spec with MTP is :func:`with_mtp` of its own class."""

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        depth = self.spec.mtp_depth
        if not depth or not roles(self.layout, stage, num_stages)[1]:
            return super()._build_chunk(stage, num_stages, layers)
        grown = (*layers[:stage], layers[stage] + depth, *layers[stage + 1 :])
        return self._plus_heads(super()._build_chunk(stage, num_stages, grown), depth)

    def _plus_heads(self, chunk: _Chunk, depth: int) -> _Chunk:
        """``chunk`` with ``depth`` projections and second output layers with their losses."""
        spec, b, t, c = self.spec, self.microbatch, self.mesh.tp, self.cp
        s, h, V = spec.seq_len, spec.hidden, spec.vocab
        tokens, esize = b * s / c, DTYPE_BYTES[self.act_dtype]
        fwd = [(tokens, V / t, h, depth), (tokens, h / t, 2 * h, depth)]
        gemms = {
            F: chunk.gemms[F] + tuple(fwd),
            I: chunk.gemms[I] + tuple((m, k, n, cnt) for m, n, k, cnt in fwd),
            W: chunk.gemms[W] + tuple((n, k, m, cnt) for m, n, k, cnt in fwd),
        }
        gemms[B] = gemms[I] + gemms[W]
        flops = depth * 2 * b * s * h * (V + 2 * h) / t / c
        loss_moved, loss_kept = loss_bytes(self.kernels)
        stored = depth * (8 * s * b * h * esize / 2 + loss_kept * b * s * V / t) / c
        traffic = {k: depth * loss_moved[k] * b * s * V / t / c for k in _KINDS}
        traffic[F] += self.efficiency.memory_traffic * stored
        traffic[I] += 2 * self.efficiency.memory_traffic * stored
        act = s * b * h * esize / c
        regather = self.sequence_parallel and t > 1
        fwd_tp, regathers, bwd_tp = mtp_tp_bytes(act, 4.0 * b * s / c, depth, regather)
        tp_bytes = dict(chunk.tp_bytes)
        tp_bytes[F] = tp_bytes[F] + fwd_tp
        # the re-gathers go after the layers' and the output layer's (tp_overlap.TpPass.regathers)
        n = chunk.layers
        at = 2 * n * (2 if self.recompute == "full" else 1) + (2 * n + 1 if regather else 0)
        tp_bytes[I] = tp_bytes[I][:at] + regathers + tp_bytes[I][at:] + bwd_tp
        tp_bytes[B] = tp_bytes[I] + tp_bytes[W]

        def plus(table, delta):
            out = {k: table[k] + delta.get(k, 0.0) for k in _KINDS}
            out[B] = out[I] + out[W]
            return MappingProxyType(out)

        memory = dict(chunk.memory)
        memory[F] += stored
        memory[I] -= stored
        memory[B] -= stored
        return _Chunk(
            plus(chunk.flops, {k: flops for k in _KINDS}),
            plus(chunk.model_flops, {k: flops for k in _KINDS}),
            MappingProxyType(tp_bytes),
            plus(chunk.traffic, traffic),
            MappingProxyType(memory),
            chunk.params + depth * (2 * h * h / t + 3 * h),
            MappingProxyType(gemms),
            chunk.attention,
            chunk.ring_bytes,
            chunk.layers,
            chunk.moe_layers,
            first=chunk.first,
            last=chunk.last,
        )


@cache
def with_mtp(cls: type[TransformerCost]) -> type[TransformerCost]:
    """``cls`` with :class:`MultiTokenPrediction` in front (one class per ``cls``, kept as an attribute
    of this module so that it pickles by name)."""
    name = f"MultiTokenPrediction{cls.__name__}"
    made = type(name, (MultiTokenPrediction, cls), {"__doc__": cls.__doc__, "__module__": __name__})
    globals()[name] = made
    return made
