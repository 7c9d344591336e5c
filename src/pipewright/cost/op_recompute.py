"""Operator-level selective recomputation as torchtitan runs it (``--recompute op``).

torchtitan's ``selective_ac_option = "op"`` (``_apply_ac_to_transformer_block`` in its
``parallelize_llama.py``, 2024-12) wraps each transformer block in PyTorch's selective checkpointing
with one policy: the outputs of ``aten.mm``, of the SDPA kernels and of the tensor-parallel
``reduce_scatter`` are saved, except every second ``mm`` (a per-layer counter: the 2nd, 4th, … matmul
of the block is recomputed); every other operator (norms, rotary embedding, SiLU, products, residual
adds, the sequence-parallel all-gathers) is recomputed in the backward. The block's input is kept by
the checkpoint.

Per layer and microbatch, per device (t tensor-parallel, s·b tokens, 16-bit activations), with the
block's matmuls in module order — q, k, v, o, then the MLP's (w1, w3, w2 for SwiGLU; fc1, fc2) — the
1st, 3rd, 5th, 7th outputs are kept: q (h/t), v (g·d/t), w1 (f/t), w2 (h, the row-parallel partial
sum) for a Llama layer; the SDPA output (h/t) and its fp32 log-sum-exp (4·a/t bytes per token); the
block input (h, /t with sequence parallelism); with t > 1 the two reduce-scatter outputs (h/t each).
The backward re-runs the other matmuls (k, o, w3: their GEMMs and FLOPs join I), the memory-bound
forward (its traffic joins I) and the all-gathers. Under FP8 the same: torchao's float8 linears
reach the checkpointing mode as ``aten.mm`` on float8 tensor subclasses (the policy's ``abs``/``max``
entries keep their scaling factors).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from pipewright.cost.chunk_memory import recompute_transient, stored_memory_bytes
from pipewright.cost.kernels import layer_traffic
from pipewright.cost.layer import kv_width, mlp_matrices
from pipewright.cost.transformer import DTYPE_BYTES, TransformerCost, _Chunk
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W


def block_matmuls(spec, t: int) -> tuple[tuple[float, float], ...]:
    """(output width, input width) per device of one block's matmuls in module order: q, k, v, o, then
    the MLP's (gate and up, then down; or up and down)."""
    h, f, kv = spec.hidden, spec.ffn_hidden, kv_width(spec)
    attn = ((h / t, h), (kv / t, h), (kv / t, h), (h, h / t))
    mlp = ((f / t, h),) * (mlp_matrices(spec) - 1) + ((h, f / t),)
    return attn + mlp


@dataclass(frozen=True, eq=False)
class OpRecomputeCost(TransformerCost):
    """:class:`TransformerCost` under torchtitan's operator-level selective recomputation (module
    docstring): memory, recomputed GEMMs, memory-bound traffic and all-gathers of the backward."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", "none")
        if self.spec.is_moe:
            raise ConfigError(
                "--recompute op prices dense layers only; use none, selective or full with experts"
            )
        if self.attention != "flash":
            raise ConfigError("--recompute op keeps SDPA's output: it needs --attention flash")
        super().__post_init__()

    def op_stored_bytes(self) -> float:
        """Bytes one layer keeps per microbatch and device, before the context-parallel split."""
        spec, t = self.spec, self.mesh.tp
        tokens = spec.seq_len * self.microbatch
        esize = DTYPE_BYTES[self.act_dtype]
        kept = sum(w for w, _ in block_matmuls(spec, t)[0::2])
        width = spec.hidden / (t if self.sequence_parallel else 1) + kept + spec.hidden / t
        if t > 1:
            width += 2 * spec.hidden / t
        return tokens * (width * esize + 4.0 * spec.heads / t)

    def layer_transient(self) -> float:
        """The operators the backward re-runs, live for one layer's backward: the layer's activations
        without recomputation less :meth:`op_stored_bytes`, /c (:func:`chunk_memory.recompute_transient`)."""
        return recompute_transient(self.cost_inputs, self.op_stored_bytes())

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        chunk = super()._build_chunk(stage, num_stages, layers)
        n = chunk.layers
        if not n:
            return chunk
        t, c = self.mesh.tp, self.cp
        tokens = self.spec.seq_len * self.microbatch / c
        mms = block_matmuls(self.spec, t)
        redo = mms[1::2]
        redo_gemms = tuple((tokens, out, k, n) for out, k in redo)
        redo_flops = sum(2 * m * out * k * cnt for m, out, k, cnt in redo_gemms)
        stored = self.layer_stored_bytes("none", fp8=False)
        forward_traffic = n * layer_traffic(self.cost_inputs, DTYPE_BYTES[self.act_dtype], stored)[0] / c
        act = tokens * self.spec.hidden * DTYPE_BYTES[self.act_dtype]
        # the sequence-parallel all-gathers before q/k/v and the MLP, re-run: one all-reduce's ring time
        gathers = (act,) * (n if t > 1 and self.sequence_parallel else 0)
        change = n * (self.op_stored_bytes() - stored_memory_bytes(self.cost_inputs, "none")) / c
        forward = chunk.memory[F] + change
        w = max(chunk.memory[W], -n * self.op_stored_bytes() / c)  # W frees linear inputs it kept
        memory = {F: forward, B: -forward, W: w, I: -(forward + w)}
        new = {
            "flops": {**chunk.flops, I: chunk.flops[I] + redo_flops, B: chunk.flops[B] + redo_flops},
            "traffic": {
                **chunk.traffic,
                I: chunk.traffic[I] + forward_traffic,
                B: chunk.traffic[B] + forward_traffic,
            },
            "gemms": {**chunk.gemms, I: chunk.gemms[I] + redo_gemms, B: chunk.gemms[B] + redo_gemms},
            "tp_bytes": {**chunk.tp_bytes, I: chunk.tp_bytes[I] + gathers, B: chunk.tp_bytes[B] + gathers},
            "memory": memory,
        }
        return replace(chunk, **{k: MappingProxyType(v) for k, v in new.items()})
