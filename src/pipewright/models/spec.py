"""ModelSpec: the dimensions of a transformer language model, shared by the cost model, the planner
and the runtime. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipewright.errors import ConfigError

#: MLP kinds: matrices per MLP — gelu and relu2 two (h→f, f→h), swiglu three (gate, up, down)
MLP_KINDS = ("gelu", "relu2", "swiglu")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT- (decoder, causal), BERT-style (encoder) or Llama-family transformer.

    l = ``layers``, h = ``hidden``, a = ``heads``, ``ffn_hidden`` (4h by default; ⌈8h/3⌉ rounded up to
    a multiple of 8 for Llama), V = ``vocab``, s = ``seq_len``. GPT parameters ≈
    12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (Megatron-LM, SC21), plus V·h more when the output layer
    is not tied to the embedding. Llama only: g = ``kv_heads`` (grouped-query attention; 0 means a)
    and the rotary base ``rope_theta``. ``mlp``: the MLP's kind, for the cost model — "gelu" (two
    matrices, GPT/BERT's default), "relu2" (two matrices, squared ReLU) or "swiglu" (three, Llama's
    default); ``bias``: linear layers and norms carry biases (default: GPT/BERT yes, Llama no).

    Mixture of experts (:mod:`pipewright.models.moe_mlp`; ``moe_experts`` 0 = dense): E = ``moe_experts``
    routed experts, each token sent to the top k = ``moe_top_k``; ``moe_shared_experts`` experts every
    token passes through; each expert an MLP of hidden size ``moe_ffn_hidden`` (0: ``ffn_hidden``); the
    first ``moe_dense_layers`` layers keep the dense MLP (DeepSeek-V3: 3). ``moe_capacity``: capacity
    factor F (each expert keeps at most ⌈F·T·k/E⌉ of a microbatch's T tokens, the rest dropped);
    0 = dropless. ``moe_aux_loss_coeff`` α and ``moe_z_loss_coeff`` β weigh the router's
    load-balancing loss E·Σᵢ fᵢ·Pᵢ (Switch Transformer) and z-loss mean(logsumexp(logits)²) (ST-MoE).

    For the cost model only (the runtime builds multi-head attention and no prediction module):
    ``attention_kind`` names the attention block in :mod:`pipewright.cost.attention_kinds` ("mha",
    or "mla": DeepSeek's multi-head latent attention); ``mtp_depth`` multi-token-prediction modules on
    the last stage (DeepSeek-V3: 1; :mod:`pipewright.cost.mtp`).

    ``layer_activations``: what the implementation of a layer keeps for its backward, for the cost
    model — "megatron" (Megatron-style layers: pipewright's own, Megatron-LM's, torchtitan's) or a set
    of :mod:`pipewright.cost.layer_activations` (a Hugging Face family's modules, which its adapter
    names: "hf-llama-sdpa", "hf-llama-eager").
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int = 0
    family: str = "gpt"
    tied_embeddings: bool = False
    kv_heads: int = 0
    rope_theta: float = 500000.0
    mlp: str = ""
    bias: bool | None = None
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_ffn_hidden: int = 0
    moe_dense_layers: int = 0
    moe_capacity: float = 0.0
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0
    attention_kind: str = "mha"
    mtp_depth: int = 0
    layer_activations: str = "megatron"

    def __post_init__(self) -> None:
        if not self.mlp:
            object.__setattr__(self, "mlp", "swiglu" if self.family == "llama" else "gelu")
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"--mlp must be one of {', '.join(MLP_KINDS)} (got {self.mlp!r})")
        if self.bias is None:
            object.__setattr__(self, "bias", self.family != "llama")
        if self.ffn_hidden == 0:
            ffn = -(-8 * self.hidden // 3 // 8) * 8 if self.family == "llama" else 4 * self.hidden
            object.__setattr__(self, "ffn_hidden", ffn)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.moe_experts:
            check_moe(self)
        if not 0 <= self.mtp_depth <= self.layers:
            raise ConfigError(
                f"--mtp-depth must be between 0 and --layers {self.layers} (got {self.mtp_depth})"
            )

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return self.moe_experts > 0

    @property
    def expert_ffn(self) -> int:
        """The hidden size of one expert's MLP (``moe_ffn_hidden``, else ``ffn_hidden``)."""
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has experts: all layers from ``moe_dense_layers`` on."""
        return self.is_moe and index >= self.moe_dense_layers

    @property
    def moe_layers(self) -> int:
        """The number of layers with experts."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def with_overrides(self, **dims: int | None) -> ModelSpec:
        """Override dimensions (``None`` keeps the preset's value)."""
        return replace(self, **{k: v for k, v in dims.items() if v is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _mlp_parameters(self, ffn: int) -> int:
        """One MLP of hidden size ``ffn``: 3hf (SwiGLU, Llama) or 2hf + f + h (GPT, with biases)."""
        h = self.hidden
        return 3 * h * ffn if self.family == "llama" else 2 * h * ffn + ffn + h

    def _moe_delta(self, experts: int) -> int:
        """Parameters a layer with ``experts`` routed experts (of E) holds beyond a dense one's MLP:
        router E·h, ``experts`` + shared expert MLPs (the shared ones as one MLP of S·f_e), less the
        dense MLP."""
        if not self.is_moe:
            return 0
        f_e, shared = self.expert_ffn, self.moe_shared_experts
        moe = self.moe_experts * self.hidden + experts * self._mlp_parameters(f_e)
        moe += self._mlp_parameters(shared * f_e) if shared else 0
        return self.moe_layers * (moe - self._mlp_parameters(self.ffn_hidden))

    def num_parameters(self) -> int:
        """Exact parameter count of the model in models/gpt.py (biases and LayerNorms included) or, for
        the Llama family, models/llama.py: l·(2h² + 2h·g·d + 3hf + 2h) + V·h + h (+ V·h untied); a
        mixture of experts counts every expert (:meth:`activated_parameters`: those one token uses)."""
        h, f, V, s, l = self.hidden, self.ffn_hidden, self.vocab, self.seq_len, self.layers
        moe = self._moe_delta(self.moe_experts)
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            return (
                l * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)
                + V * h
                + h
                + (0 if self.tied_embeddings else V * h)
                + moe
            )
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attn, mlp, 2 LayerNorms
        embed = V * h + s * h
        head = 2 * h + (0 if self.tied_embeddings else V * h)  # final LayerNorm + output
        return l * per_layer + embed + head + moe

    def activated_parameters(self) -> int:
        """Parameters one token's forward uses: :meth:`num_parameters` with k of the E routed experts
        per layer (the router and the shared experts included); equal to it for a dense model."""
        return self.num_parameters() - self._moe_delta(self.moe_experts) + self._moe_delta(self.moe_top_k)


def check_moe(spec: ModelSpec) -> None:
    """One-line ConfigErrors for a mixture-of-experts shape that cannot be built."""
    e, k = spec.moe_experts, spec.moe_top_k
    if e < 0:
        raise ConfigError(f"--moe-experts must be 0 (dense) or more (got {e})")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-top-k {k} must be between 1 and --moe-experts {e}")
    for name in ("moe_shared_experts", "moe_ffn_hidden", "moe_dense_layers"):
        if getattr(spec, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more (got {getattr(spec, name)})")
    for name in ("moe_capacity", "moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(spec, name)
        if not value >= 0 or value == float("inf"):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number ≥ 0 (got {value})")
