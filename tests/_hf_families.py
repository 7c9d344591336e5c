"""Tiny random Hugging Face decoder configs, one per family the ``--hf-model`` path supports (no
download): hidden 32, 4 layers, 4 query heads (2 key/value heads where the family has grouped-query
attention), vocabulary 96, eager attention, no dropout."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 96
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    **_TOKENS,
}

#: family name -> config.json contents
FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama", **_DECODER},
    "mistral": {"model_type": "mistral", **_DECODER, "sliding_window": 6},
    "qwen2": {"model_type": "qwen2", **_DECODER},
    "qwen3": {"model_type": "qwen3", **_DECODER, "head_dim": 8},
    "gemma2": {
        "model_type": "gemma2",
        **_DECODER,
        "head_dim": 8,
        "tie_word_embeddings": True,
        "sliding_window": 6,
        "final_logit_softcapping": 5.0,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        **_DECODER,
        "head_dim": 8,
        "tie_word_embeddings": True,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "phi3": {"model_type": "phi3", **_DECODER},
    "olmo": {"model_type": "olmo", **_DECODER},
    "olmo2": {"model_type": "olmo2", **_DECODER},
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": VOCAB,
        "n_embd": 32,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        **_TOKENS,
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        **_TOKENS,
    },
}


def write_family(folder: Path, name: str) -> Path:
    """Write family ``name``'s config.json (eager attention) into ``folder/name``; returns that folder."""
    return write_config(folder, name, FAMILIES[name])


#: mixtures of experts (transformers' own experts; output_router_logits false: the loss is the
#: cross-entropy, as transformers computes it then) and two families without an adapter
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": {"model_type": "mixtral", **_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        **_DECODER,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
}
UNADAPTED: dict[str, dict] = {
    "granite": {
        "model_type": "granite",
        **_DECODER,
        "embedding_multiplier": 12.0,
        "logits_scaling": 8.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015,
    },
    "cohere": {"model_type": "cohere", **_DECODER},
}


def write_config(folder: Path, name: str, config: dict) -> Path:
    """Write ``config`` (eager attention) as ``folder/name/config.json``; returns that folder."""
    out = folder / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    return out
