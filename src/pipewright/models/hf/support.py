"""Which Hugging Face models ``--hf-model`` trains as ``transformers`` does, and the one-line refusals.

- A ``model_type`` with an adapter (:data:`~pipewright.models.hf.adapters.ADAPTERS`) is cut by its
  adapter. Any other type is accepted only when :func:`forward_matches` holds: a random copy of its
  config with two layers (vocabulary at most 512, MLP width at most 256), cut into pipewright's
  stage modules, gives exactly the logits of ``transformers``' own forward. Granite (embedding and
  logit multipliers in the model's forward) and Cohere (a logit scale there) do not, and are refused
  naming the type.
- Mixtures of experts (``num_local_experts`` / ``num_experts``: Mixtral, Qwen2-MoE) train with
  ``transformers``' experts; their size comes from config.json, so the ``--moe-*`` flags are refused,
  and ``--ep`` (which shards pipewright's own MoE layers) too. ``transformers`` adds the router's
  load-balancing loss only when ``output_router_logits`` is true; then so do the stages
  (models/hf/router_loss.py), whose boundaries carry :func:`carry_rows` more rows (not with ``--cp``).
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

from pipewright.errors import ConfigError
from pipewright.models.hf.adapters import ADAPTERS, adapter_for
from pipewright.models.hf.build import load_config, stage_from_model
from pipewright.models.hf.router_loss import experts, rows

_PROBE_LAYERS, _PROBE_VOCAB, _PROBE_SEQ, _PROBE_FFN = 2, 512, 8, 256


def check_options(config, hf_config) -> None:
    """One-line errors for TrainConfig ``config`` options that a Hugging Face model cannot take."""
    given = [flag for flag, value in _moe_values(config).items() if value is not None]
    kind = hf_config.model_type
    if given:
        flags = ", ".join(given)
        raise ConfigError(
            f"--hf-model takes its experts from config.json (model_type {kind!r}, {experts(hf_config)} "
            f"experts); drop {flags}"
        )
    ep = config.ep
    if ep > 1:
        count = experts(hf_config)
        what = f"{count} experts that stay whole on every rank" if count else "no experts"
        raise ConfigError(
            f"--ep {ep} shards pipewright's own mixture-of-experts layers; model_type {kind!r} has {what} "
            "under --hf-model; drop --ep"
        )
    if carry_rows(hf_config) and config.cp > 1:
        raise ConfigError(
            f"model_type {kind!r} sets output_router_logits: its router loss's sums travel beside the "
            f"sequence between stages, which --cp {config.cp} splits; use --cp 1"
        )
    check_supported(hf_config)


def _moe_values(config) -> dict[str, object]:
    """TrainConfig ``config``'s mixture-of-experts options by flag (a Hugging Face config decides
    them; None: not given)."""
    return {
        "--moe-experts": config.moe_experts,
        "--moe-top-k": config.moe_top_k,
        "--moe-shared-experts": config.moe_shared_experts,
        "--moe-ffn-hidden": config.moe_ffn_hidden,
        "--moe-dense-layers": config.moe_dense_layers,
        "--moe-capacity": config.moe_capacity,
        "--moe-aux-loss-coeff": config.moe_aux_loss_coeff,
        "--moe-z-loss-coeff": config.moe_z_loss_coeff,
    }


def carry_rows(hf_config) -> int:
    """Rows a stage boundary carries for the router loss (models/hf/router_loss.py; 0: none)."""
    count = experts(hf_config)
    if not count or not getattr(hf_config, "output_router_logits", False):
        return 0
    return rows(count, hf_config.hidden_size)


def boundary_rows(source: str) -> int:
    """:func:`carry_rows` of the ``--hf-model`` at ``source``."""
    return carry_rows(load_config(source))


def check_supported(hf_config) -> None:
    """Nothing for a type with an adapter or whose forward matches; else a one-line ConfigError."""
    kind = hf_config.model_type
    if kind in ADAPTERS:
        return
    difference = _probe(kind, hf_config.to_json_string(use_diff=False))
    if difference:
        raise ConfigError(
            f"Hugging Face model_type {kind!r} is not supported: pipewright's stages of a random "
            f"{_PROBE_LAYERS}-layer copy differ from transformers' forward ({difference})"
        )


def forward_matches(hf_config) -> str:
    """'' when pipewright's stage modules of a small random copy of ``hf_config`` give exactly
    ``transformers``' logits; else what differs."""
    import transformers

    small = copy.deepcopy(hf_config)
    small.num_hidden_layers = _PROBE_LAYERS
    if getattr(small, "intermediate_size", 0) > _PROBE_FFN:  # the same operations, smaller
        small.intermediate_size = _PROBE_FFN
    if getattr(small, "layer_types", None):
        small.layer_types = list(small.layer_types)[:_PROBE_LAYERS]
    if small.vocab_size > _PROBE_VOCAB:
        small.vocab_size = _PROBE_VOCAB
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(small, name, None), int) and getattr(small, name) >= _PROBE_VOCAB:
                setattr(small, name, None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        ids = torch.randint(0, small.vocab_size, (2, _PROBE_SEQ))
    try:
        stage = stage_from_model(model, None, 0, 1)
    except ConfigError as exc:
        return str(exc)
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, stage(ids)
    if want.shape == got.shape and torch.equal(want, got):
        return ""
    if want.shape != got.shape:
        return f"logits of shape {tuple(got.shape)}, not {tuple(want.shape)}"
    return f"logits differ by up to {float((want - got).abs().max()):.3g}"


@lru_cache(maxsize=16)
def _probe(kind: str, config_json: str) -> str:
    import transformers

    config = transformers.AutoConfig.for_model(kind, **_json(config_json))
    config._attn_implementation = "eager"
    return forward_matches(config)


def _json(text: str) -> dict:
    import json

    data = json.loads(text)
    data.pop("model_type", None)
    return data


def check_train_options(config) -> None:
    """One-line errors for training options that contradict ``--hf-model`` (``config``: a TrainConfig)."""
    check_options(config, load_config(config.hf_model))
    if config.init_from:
        raise ConfigError("--hf-model reads its weights from model.safetensors; drop --init-from")
    dimensions = {
        "--layers": config.layers,
        "--hidden": config.hidden,
        "--heads": config.heads,
        "--kv-heads": config.kv_heads,
        "--ffn-hidden": config.ffn_hidden,
        "--vocab": config.vocab,
    }
    given = [flag for flag, value in dimensions.items() if value]
    if given:
        flags = ", ".join(given)
        raise ConfigError(f"--hf-model takes the model's dimensions from its config.json; drop {flags}")
    if config.tp > 1:
        hf = load_config(config.hf_model)
        adapter = adapter_for(hf.model_type)
        if not adapter.tp_kinds:
            raise ConfigError(
                f"tensor parallelism: model_type {hf.model_type!r} cannot be split ({adapter.tp_blocker}); "
                "use --tp 1"
            )
        if config.sequence_parallel:
            raise ConfigError("--sequence-parallel is not supported for --hf-model; drop it")
    if config.tie_embeddings:
        raise ConfigError(
            "--hf-model ties embeddings as its config.json says (tie_word_embeddings); drop --tie-embeddings"
        )
