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

    def with_overrides(self, **dims: int | None) -> ModelSpec:
        """Override dimensions (``None`` keeps the preset's value)."""
        return replace(self, **{k: v for k, v in dims.items() if v is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        """Exact parameter count of the model in models/gpt.py (biases and LayerNorms included) or, for
        the Llama family, models/llama.py: l·(2h² + 2h·g·d + 3hf + 2h) + V·h + h (+ V·h untied)."""
        h, f, V, s, l = self.hidden, self.ffn_hidden, self.vocab, self.seq_len, self.layers
        if self.family == "llama":
            kv = self.kv_heads * self.head_dim
            return (
                l * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)
                + V * h
                + h
                + (0 if self.tied_embeddings else V * h)
            )
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attn, mlp, 2 LayerNorms
        embed = V * h + s * h
        head = 2 * h + (0 if self.tied_embeddings else V * h)  # final LayerNorm + output
        return l * per_layer + embed + head
