"""The :class:`~pipewright.models.spec.ModelSpec` a RunSpec's model section names: the one reading of
``[model]`` that ``simulate`` and ``plan`` price and ``train`` builds (a Hugging Face model's, read from
its config, aside: :meth:`pipewright.runtime.setup.config.TrainConfig.model_spec`). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pipewright.models.presets import MOE_FIELDS, resolve_model

if TYPE_CHECKING:
    from pipewright.models.spec import ModelSpec
    from pipewright.runspec.model_sections import ModelSection


def model_spec(model: ModelSection, default_vocab: int | None = None) -> ModelSpec:
    """The preset (or family) ``model.model`` with the dimensions, mixture of experts (its routing and
    losses too), attention kind, multi-token-prediction depth, MLP kind, biases and tied embeddings the
    section gives
    (:func:`pipewright.models.presets.resolve_model`). ``default_vocab``: the vocabulary where the
    section gives none (``train``: the dataset's; None: the preset's)."""
    moe = model.moe
    spec = resolve_model(
        model.model,
        layers=model.layers,
        hidden=model.hidden,
        heads=model.heads,
        ffn_hidden=model.ffn_hidden,
        kv_heads=model.kv_heads,
        vocab=model.vocab or default_vocab,
        seq_len=model.seq_len,
        **{name: getattr(moe, name.removeprefix("moe_")) for name in MOE_FIELDS},
        attention_kind=model.attention_kind,
        mtp_depth=model.mtp_depth,
    )
    if model.mlp or model.no_bias:
        spec = replace(spec, mlp=model.mlp or spec.mlp, bias=False if model.no_bias else spec.bias)
    return tied(spec, model)


def tied(spec: ModelSpec, model: ModelSection) -> ModelSpec:
    """``spec`` with its output layer tied to the input embedding where the section asks
    (``model.tie_embeddings``; a preset that ties, BERT, stays tied): one V·h table where one stage
    holds both, a kept-equal copy on the last stage otherwise (docs/cost-model.md, "Tied embeddings")."""
    return replace(spec, tied_embeddings=True) if model.tie_embeddings else spec
