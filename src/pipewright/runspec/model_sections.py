"""RunSpec sections. What is trained: the model and its mixture of experts. Each field is declared once
(:func:`~pipewright.runspec.fields.spec_field`): type, default, flag, help, the commands that take it.
Pure Python.
"""

from __future__ import annotations

from pipewright.models.presets import PRESETS
from pipewright.runspec.choices import AttentionKind, Mlp
from pipewright.runspec.fields import MODEL_COMMANDS, PRICING, TRAINING, section, spec_field, subsection


def _presets() -> str:
    """The model presets for ``--model``'s help, the mixture-of-experts ones named as such."""
    dense = [n for n, s in PRESETS.items() if not s.moe_experts]
    moe = [n for n, s in PRESETS.items() if s.moe_experts]
    return f"presets: {', '.join(dense)}; mixture of experts: {', '.join(moe)}"


@section
class MoESection:
    """Mixture of experts: experts, routing and their losses (``[model.moe]``)."""

    experts: int | None = spec_field(
        None,
        "--moe-experts",
        "routed experts E (a mixture of experts; default: the preset's)",
        commands=MODEL_COMMANDS,
        minimum=1,
    )
    top_k: int | None = spec_field(
        None,
        "--moe-top-k",
        "experts each token is routed to (default: the preset's, else 2)",
        commands=MODEL_COMMANDS,
        minimum=1,
    )
    shared_experts: int | None = spec_field(
        None,
        "--moe-shared-experts",
        "experts every token passes through (DeepSeekMoE)",
        commands=MODEL_COMMANDS,
    )
    ffn_hidden: int | None = spec_field(
        None,
        "--moe-ffn-hidden",
        "FFN width of one expert",
        commands=MODEL_COMMANDS,
        minimum=1,
    )
    dense_layers: int | None = spec_field(
        None,
        "--moe-dense-layers",
        "first layers that keep the dense MLP (DeepSeek-V3: 3)",
        commands=MODEL_COMMANDS,
    )
    imbalance: float = spec_field(
        1.0,
        "--moe-imbalance",
        ("expert load imbalance: the busiest device's expert tokens over the even split (≥ 1)"),
        commands=PRICING,
    )
    capacity: float | None = spec_field(
        None,
        "--moe-capacity",
        "capacity factor (tokens over capacity dropped; 0: dropless)",
        commands=TRAINING,
    )
    aux_loss_coeff: float | None = spec_field(
        None,
        "--moe-aux-loss-coeff",
        "load-balancing loss coefficient (default 0.01)",
        commands=TRAINING,
    )
    z_loss_coeff: float | None = spec_field(
        None,
        "--moe-z-loss-coeff",
        "router z-loss coefficient (default 0)",
        commands=TRAINING,
    )


@section
class ModelSection:
    """The model: a preset or family and the dimensions that override it (``[model]``)."""

    model: str | None = spec_field(
        None,
        "--model",
        f"a preset or a family gpt|llama ({_presets()})",
        commands=("simulate", "plan", "train", "check", "profile"),
        variants={
            "train": {"default": "gpt-small-cpu"},
            "check": {"default": "gpt-small-cpu"},
            "profile": {"help": "preset (default gpt-small-cpu) or family gpt"},
        },
    )
    layers: int | None = spec_field(
        None,
        "--layers",
        "transformer layers (default: the preset's)",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
    )
    hidden: int | None = spec_field(
        None,
        "--hidden",
        "hidden size h (default: the preset's)",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
    )
    heads: int | None = spec_field(
        None,
        "--heads",
        "attention heads (default: the preset's)",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
    )
    ffn_hidden: int | None = spec_field(
        None,
        "--ffn-hidden",
        "MLP hidden size (default 4h)",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
    )
    vocab: int | None = spec_field(
        None,
        "--vocab",
        "vocabulary size (default: the preset's; train: the dataset's)",
        commands=("simulate", "plan", "train", "check", "profile", "calibrate"),
        minimum=1,
        variants={"calibrate": {"default": 50257, "help": "vocabulary size (the file has none)"}},
    )
    seq_len: int | None = spec_field(
        None,
        "--seq-len",
        "sequence length (default: the preset's)",
        commands=("simulate", "plan", "train", "check", "profile"),
        minimum=1,
    )
    kv_heads: int | None = spec_field(
        None,
        "--kv-heads",
        "key/value heads (grouped-query attention, Llama; default: --heads)",
        commands=MODEL_COMMANDS,
        minimum=1,
    )
    mlp: Mlp | None = spec_field(
        None,
        "--mlp",
        "MLP kind",
        commands=PRICING,
    )
    no_bias: bool = spec_field(
        False,
        "--no-bias",
        "linear layers and norms without biases",
        commands=PRICING,
    )
    attention_kind: AttentionKind | None = spec_field(
        None,
        "--attention-kind",
        ("attention block: mha, or mla (DeepSeek's multi-head latent attention; default: the preset's)"),
        commands=PRICING,
    )
    mtp_depth: int | None = spec_field(
        None,
        "--mtp-depth",
        ("multi-token-prediction modules on the last stage (DeepSeek-V3: 1; default: the preset's)"),
        commands=PRICING,
    )
    tie_embeddings: bool = spec_field(
        False,
        "--tie-embeddings",
        "tie the output layer to the input embedding (also across stages)",
        commands=MODEL_COMMANDS,
    )
    init_from: str | None = spec_field(
        None,
        "--init-from",
        "Hugging Face checkpoint folder (GPT-2 or Llama config.json + safetensors)",
        commands=TRAINING,
    )
    hf_model: str | None = spec_field(
        None,
        "--hf-model",
        ("Hugging Face model folder or config.json, built with transformers (weights if model.safetensors)"),
        commands=TRAINING,
    )
    moe: MoESection = subsection(MoESection)
