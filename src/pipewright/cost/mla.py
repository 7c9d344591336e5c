"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, §2.1; DeepSeek-V3, arXiv 2412.19437,
§2.1.1) in the cost model.

Per layer, hidden h, a heads; query rank r_q (0: queries projected from h directly, as DeepSeek-V2-Lite),
key/value rank r_kv, per-head widths d_n (no rotary), d_r (rotary, one key part shared by all heads)
and d_v (value); the query/key head width is d_qk = d_n + d_r. DeepSeek-V2 and V3: r_q 1536, r_kv 512,
d_n 128, d_r 64, d_v 128 (a = 128, h = 7168 for V3). The forward's GEMMs on T tokens, per device at
tensor-parallel size t (the down-projections replicated on every rank, the up-projections
column-parallel and the output row-parallel, as Megatron-Core's MLA splits them):

- query down T × r_q × h, query up T × a·d_qk/t × r_q (RMSNorm of the latent between them);
- key/value down T × (r_kv + d_r) × h (the latent and the shared rotary key), key/value up
  T × a·(d_n + d_v)/t × r_kv (RMSNorm of the latent before it);
- output T × h × a·d_v/t.

FLOPs 2·m·n·k each; V3 per token and layer: 2 × 187.1 × 10⁶ (multi-head attention of width 7168:
2 × 205.5 × 10⁶). Each GEMM runs twice more in the backward: input gradient in I, weight gradient in W,
as :mod:`pipewright.cost.transformer` splits dense layers.

Attention core: Q·Kᵀ over d_qk per head and scores·V over d_v, 2·b·s²·a·(d_qk + d_v) forward over the
whole s × s square (multi-head attention's 4·b·s²·h at d_qk = d_v = h/a); V3: 2·b·s²·128·320, 2.86 × the
4·b·s²·h of multi-head attention of width 7168.

Parameters: h·r_q + r_q·a·d_qk + h·(r_kv + d_r) + r_kv·a·(d_n + d_v) + a·d_v·h and the two latent
RMSNorm gains r_q + r_kv; V3 187,107,328 per layer (no biases).

Stored for the backward (``recompute_up``, as DeepSeek-V3 trains, §3.2.3: "we recompute all RMSNorm
operations and MLA up-projections during back-propagation"): the layer norm's input and the
down-projections' input (2 bytes per element each, 1 as an FP8 copy) and the compressed latents c_q,
c_kv and the rotary key k_r, 2·(r_q + r_kv + d_r) bytes per token, replicated over t; the attention
output (the output projection's input, 2·a·d_v/t bytes per token, 1 as FP8). The up-projected
queries, keys and values are recomputed from the latents in the backward: the up-projection GEMMs run
once more in I (executed FLOPs, not model FLOPs). Without ``recompute_up`` (Megatron-Core's default)
the normalised latents 2·(r_q + r_kv) and q, k, v 2·a·(2·d_qk + d_v)/t bytes per token are kept instead
of the recomputation.

Context parallelism: the ring passes the up-projected keys and values, a·(d_qk + d_v) elements per token
(Megatron-Core and Transformer Engine run MLA's core as ordinary attention with unequal head widths).

Approximation: the fused attention backward's recomputed Q·Kᵀ is priced as half the core, the rule of
:mod:`pipewright.cost.transformer`; for MLA it is d_qk/(d_qk + d_v) = 0.6 of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.models.spec import ModelSpec

Gemm = tuple[float, float, float]


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's shape (module docstring); heads and hidden come from the spec."""

    q_rank: int = 1536
    kv_rank: int = 512
    nope_dim: int = 128
    rope_dim: int = 64
    v_dim: int = 128
    recompute_up: bool = True

    @property
    def qk_dim(self) -> int:
        """d_qk = d_n + d_r: the query and key width of one head."""
        return self.nope_dim + self.rope_dim

    def _query(self, spec: ModelSpec, tokens: float, t: int) -> tuple[Gemm, ...]:
        h, out = spec.hidden, spec.heads * self.qk_dim / t
        if not self.q_rank:
            return ((tokens, out, h),)
        return ((tokens, self.q_rank, h), (tokens, out, self.q_rank))

    def _kv_up(self, spec: ModelSpec, tokens: float, t: int) -> Gemm:
        return (tokens, spec.heads * (self.nope_dim + self.v_dim) / t, self.kv_rank)

    def gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
        """The forward's five GEMMs (four without query compression), per device."""
        h = spec.hidden
        kv_down = (tokens, self.kv_rank + self.rope_dim, h)
        out = (tokens, h, spec.heads * self.v_dim / t)
        return (*self._query(spec, tokens, t), kv_down, self._kv_up(spec, tokens, t), out)

    def recomputed_gemms(self, spec: ModelSpec, tokens: float, t: int = 1) -> tuple[Gemm, ...]:
        """The up-projections, re-run in the backward with ``recompute_up``."""
        if not self.recompute_up:
            return ()
        query_up = self._query(spec, tokens, t)[1:] if self.q_rank else ()
        return (*query_up, self._kv_up(spec, tokens, t))

    def core_flops(self, spec: ModelSpec, b: int) -> float:
        """2·b·s²·a·(d_qk + d_v)."""
        return 2 * b * spec.seq_len * spec.seq_len * spec.heads * (self.qk_dim + self.v_dim)

    def parameters(self, spec: ModelSpec) -> int:
        """The projections and the two latent norm gains (no biases)."""
        h, a, r_q, r_kv = spec.hidden, spec.heads, self.q_rank, self.kv_rank
        query = h * r_q + r_q * a * self.qk_dim + r_q if r_q else h * a * self.qk_dim
        kv = h * (r_kv + self.rope_dim) + r_kv * a * (self.nope_dim + self.v_dim) + r_kv
        return query + kv + a * self.v_dim * h

    def stored_units(self, spec: ModelSpec, fp8: bool = False) -> tuple[float, float]:
        """(replicated, tensor-parallel) stored bytes in units of s·b·h (module docstring)."""
        h, a, gemm_input = spec.hidden, spec.heads, 1 if fp8 else 2
        latents = 2 * (self.q_rank + self.kv_rank + self.rope_dim) / h
        replicated = 2 + gemm_input + latents
        parallel = gemm_input * a * self.v_dim / h
        if not self.recompute_up:
            replicated += gemm_input * (self.q_rank + self.kv_rank) / h
            parallel += 2 * a * (2 * self.qk_dim + self.v_dim) / h
        return replicated, parallel

    def ring_width(self, spec: ModelSpec) -> int:
        """a·(d_qk + d_v): the up-projected keys and values per token."""
        return spec.heads * (self.qk_dim + self.v_dim)


#: DeepSeek-V2's and V3's MLA (V3 §4.2: r_q 1536, r_kv 512, d_n 128, d_r 64, d_v 128), with the
#: up-projections recomputed in the backward as DeepSeek-V3 trains
DEEPSEEK_V3_MLA = LatentAttention()
