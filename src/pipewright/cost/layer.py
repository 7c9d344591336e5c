"""One decoder layer of any dense transformer, by what it is made of: GEMMs, attention, stored bytes.

Per layer and microbatch of b sequences of length s; hidden h, heads a, key/value width g·d (g
key/value heads of size d = h/a; g·d = h without grouped-query attention), FFN f, MLP matrices
μ (2 for gelu/relu2, 3 for swiglu):

The attention block is the spec's attention kind (:mod:`pipewright.cost.attention_kinds`: multi-head
attention below, or multi-head latent attention, :mod:`pipewright.cost.mla`); the rest is every kind's.

- GEMMs of the forward (m × n × k, per device at tensor-parallel size t and context-parallel size c,
  on T = b·s/c tokens): QKV T × (h + 2gd)/t × h; attention output T × h × h/t; MLP up T × (μ−1)·f/t × h
  (gate and up fused for swiglu); MLP down T × h × f/t. Their FLOPs: 2·b·s·h·(2h + 2gd + μf) —
  GPT's 8bsh² + 4bshf, Llama's 4bsh² + 4bsh·gd + 6bshf. The backward runs each GEMM twice: the input
  gradient (same FLOPs, in I) and the weight gradient (same FLOPs, in W).
- Attention core: 4·b·s²·h FLOPs forward (Q·Kᵀ and scores·V, counted over the whole s × s square as
  Megatron-LM does); its backward 2× that (in I).
- Parameters: h·(h + 2gd) + h² + μ·h·f, with biases (h + 2gd) + h + (μ−1)·f + h, and two norms of
  2h (LayerNorm) or h (RMSNorm, no bias) each: GPT 12h² + 13h at f = 4h, Llama 2h² + 2h·gd + 3hf + 2h.
- Stored activation bytes (16-bit; Korthikanti et al. 2022, Table 2, generalised): outside the
  tensor-parallel regions the two norm inputs 4·sbh, the QKV and MLP inputs 2·sbh each and, with
  dropout (GPT/BERT), two masks sbh each; inside them (/t) q 2·sbh, k and v 4·sbh·gd/h, the output
  projection's input 2·sbh and the MLP's intermediate tensors 2·sbf per tensor (gelu: its input and
  output; swiglu: gate, up and the product's input); the eager attention scores a·s²·b·(2 + dropout
  mask 1 + dropout output 2) /t. GPT at f = 4h: s·b·h·(10 + 24/t + 5·a·s/(h·t)); Llama:
  s·b·h·(8 + (4 + 4gd/h + 6f/h)/t) + 2·a·s²·b/t. Sequence parallelism divides the replicated part by t
  too; context parallelism divides every s·b·h term and the scores by c.
"""

from __future__ import annotations

from pipewright.cost.attention_kinds import Gemm, attention_of, gemm_flops
from pipewright.cost.attention_kinds import kv_width as kv_width  # re-exported: g·d of MHA
from pipewright.cost.layer_activations import activation_set
from pipewright.models.spec import ModelSpec


def mlp_matrices(spec: ModelSpec) -> int:
    """μ: 3 matrices for swiglu (gate, up, down), 2 for gelu and relu2."""
    return 3 if spec.mlp == "swiglu" else 2


def has_dropout(spec: ModelSpec) -> bool:
    """GPT/BERT train with dropout (masks stored); Llama-family models do not; a layer implementation
    of :mod:`pipewright.cost.layer_activations` says."""
    kept = activation_set(spec)
    return kept.dropout if kept is not None else spec.family != "llama"


def mlp_gemms(spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
    """The dense MLP's two forward GEMMs on ``tokens`` tokens, per device: up (and gate), down."""
    h, f, mu = spec.hidden, spec.ffn_hidden, mlp_matrices(spec)
    return ((tokens, (mu - 1) * f / t, h), (tokens, h, f / t))


def layer_gemms(spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
    """The forward's GEMMs of one layer on ``tokens`` tokens, per device: the attention kind's, then
    the MLP's (module docstring)."""
    return attention_of(spec).gemms(spec, tokens, t) + mlp_gemms(spec, tokens, t)


def layer_recomputed_gemms(spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
    """GEMMs the attention kind re-runs in the backward (MLA's up-projections; none for MHA)."""
    return attention_of(spec).recomputed_gemms(spec, tokens, t)


def layer_linear_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of one layer's GEMMs (whole layer): 2·b·s·h·(2h + 2gd + μf) with multi-head
    attention."""
    return gemm_flops(layer_gemms(spec, b * spec.seq_len))


def attention_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of one layer's attention core: 4·b·s²·h with multi-head attention."""
    return attention_of(spec).core_flops(spec, b)


def layer_forward_flops(spec: ModelSpec, b: int) -> float:
    """Forward FLOPs of one layer: GEMMs + attention (GPT: 8bsh² + 4bshf + 4bs²h; Megatron-LM's
    24bsh² + 4bs²h at f = 4h)."""
    return layer_linear_flops(spec, b) + attention_flops(spec, b)


def layer_parameters(spec: ModelSpec) -> int:
    """Parameters of one layer (module docstring; GPT 4h² + 2hf + 9h + f, Llama 2h² + 2h·gd + 3hf + 2h)."""
    h, f, mu = spec.hidden, spec.ffn_hidden, mlp_matrices(spec)
    mlp = mu * h * f + ((mu - 1) * f + h if spec.bias else 0)
    return attention_of(spec).parameters(spec) + mlp + 2 * norm_parameters(spec)


def norm_parameters(spec: ModelSpec) -> int:
    """One norm's parameters: 2h with a bias (LayerNorm), h without (RMSNorm)."""
    return 2 * spec.hidden if spec.bias else spec.hidden


def replicated_parameters(spec: ModelSpec, layers: int, last: bool, mtp: int = 0) -> float:
    """Parameters a chunk holds whole on every tensor-parallel rank that sequence parallelism feeds
    different tokens (so their gradients are all-reduced over tp once a step, Megatron-LM's
    ``_allreduce_layernorm_grads``): each layer's two norms and, with biases, its two row-parallel
    linears' biases (2h) — Llama 2h a layer, GPT 6h; the final norm (``last``). Not the learned
    position table (GPT): it is added before the embedding's reduce-scatter, whose all-gather backward
    gives it the whole gradient on every tp rank (the runtime and Megatron-LM reduce it with dp only).
    ``mtp`` multi-token-prediction modules add their three norms each (Megatron-Core's enorm, hnorm
    and final_layernorm; their blocks are in ``layers``)."""
    per_layer = 2 * norm_parameters(spec) + (2 * spec.hidden if spec.bias else 0)
    return layers * per_layer + (norm_parameters(spec) if last else 0) + 3 * mtp * norm_parameters(spec)


def embedding_parameters(spec: ModelSpec, t: int = 1) -> float:
    """The embedding stage's parameters per device: V·h/t, plus the learned position table s·h
    (GPT/BERT; Llama's rotary embedding has none)."""
    pos = 0 if spec.family == "llama" else spec.seq_len * spec.hidden
    return spec.vocab * spec.hidden / t + pos


def head_parameters(spec: ModelSpec, t: int = 1) -> float:
    """The output stage's parameters per device: the final norm and a V·h/t output layer."""
    return spec.vocab * spec.hidden / t + norm_parameters(spec)


def shared_table_parameters(spec: ModelSpec, t: int = 1) -> float:
    """The V·h/t parameters a tied model's output layer shares with the embedding where one stage
    holds both (the runtime's ``build_stage`` makes them one Parameter: no second weight, gradient or
    optimizer state); 0 untied. On different stages the last keeps its own copy (Megatron-LM's, whose
    gradient is all-reduced with the embedding's each step:
    :func:`pipewright.cost.sharding.tied_step_bytes`)."""
    return spec.vocab * spec.hidden / t if spec.tied_embeddings else 0.0


def edge_parameters(spec: ModelSpec, t: int, first: bool, last: bool) -> float:
    """Parameters per device of a chunk's embedding (``first``) and output stage (``last``):
    :func:`embedding_parameters` + :func:`head_parameters`, less the shared table when one chunk holds
    both of a tied model (:func:`shared_table_parameters`)."""
    shared = shared_table_parameters(spec, t) if first and last else 0.0
    return (
        (embedding_parameters(spec, t) if first else 0.0)
        + (head_parameters(spec, t) if last else 0.0)
        - shared
    )


def layer_stored_units(
    spec: ModelSpec, t: int = 1, sequence_parallel: bool = False, scores: bool = True, fp8: bool = False
) -> float:
    """Stored 16-bit bytes of one layer's forward without recomputation, in units of s·b·h (module
    docstring); ``scores``: the eager a·s² attention scores are kept (not with flash attention, nor
    with selective recomputation); ``fp8``: the four GEMM inputs (QKV and MLP inputs outside the
    tensor-parallel regions, the output projection's and the down projection's inside) are kept as
    their FP8 copies, half the bytes (Transformer Engine saves the cast inputs for the backward)."""
    h, f = spec.hidden, spec.ffn_hidden
    dropout = has_dropout(spec)
    attn_replicated, attn_parallel = attention_of(spec).stored_units(spec, fp8)
    # the MLP's norm input and input (its FP8 copy), the two dropout masks
    replicated = attn_replicated + 4 + (2 if dropout else 0) - (1 if fp8 else 0)
    mlp = (6 if spec.mlp == "swiglu" else 4) * f / h - (f / h if fp8 else 0)
    parallel = attn_parallel + mlp
    units = replicated / (t if sequence_parallel else 1) + parallel / t
    if scores:
        units += (5 if dropout else 2) * spec.heads * spec.seq_len / (h * t)
    return units
