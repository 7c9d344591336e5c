"""ModelSpec: the dimensions of a transformer language model, shared by the cost model, the planner
and the runtime. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    """A GPT- (decoder, causal) or BERT-style (encoder) transformer.

    l = ``layers``, h = ``hidden``, a = ``heads``, ``ffn_hidden`` (4h by default), V = ``vocab``,
    s = ``seq_len``. Parameters ≈ 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (Megatron-LM, SC21),
    plus V·h more when the output layer is not tied to the embedding.
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

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)

    def with_overrides(self, **dims: int | None) -> ModelSpec:
        """Override dimensions (``None`` keeps the preset's value)."""
        return replace(self, **{k: v for k, v in dims.items() if v is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        """Exact parameter count of the GPT model in models/gpt.py (biases and LayerNorms included)."""
        h, f, V, s, l = self.hidden, self.ffn_hidden, self.vocab, self.seq_len, self.layers
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attn, mlp, 2 LayerNorms
        embed = V * h + s * h
        head = 2 * h + (0 if self.tied_embeddings else V * h)  # final LayerNorm + output
        return l * per_layer + embed + head
