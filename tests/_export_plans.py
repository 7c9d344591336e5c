"""The large-model plans the export tests feed to the trainers: GPT-3 175B, Llama 3 70B (uneven
interleaved chunks, cp) and 405B (uneven, cp), Mixtral 8×7B (ep 8), DeepSeek-V3 (256 experts, dense first
layers, shared expert, latent attention, multi-token prediction, ep 16), an FSDP plan and a ZB-V plan;
and Megatron-Core's per-rank layer assignment of a config."""

from __future__ import annotations

from pipewright.models.presets import get_preset
from pipewright.plan.planfile import check_schema, model_json


def _plan(model: str, tp: int, pp: int, dp: int, layout: str, **extra) -> dict:
    spec = get_preset(model)
    padded = -(-spec.vocab // (128 * tp)) * 128 * tp
    data = {
        "format": "pipewright-plan",
        "version": 1,
        "model": model_json(spec, padded),
        "topology": "any",
        "rank_order": "tp-dp-pp",
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "virtual": 1,
        "schedule": "1f1b",
        "microbatch_size": 1,
        "microbatches": 4 * pp,
        "global_batch_size": 4 * pp * dp,
        "recompute": "selective",
        "sequence_parallel": tp > 1,
        "dtype": "bf16",
        "optimizer_sharding": "zero1",
        "layout": layout,
        "devices": [],
        **extra,
    }
    check_schema(data)
    return data


def _chunked(first: int, middle: int, count: int, last: int) -> str:
    return "|".join([f"Et*{first}", *[f"t*{middle}"] * count, f"t*{last}L"])


PLANS = {
    "gpt3-175b": _plan("gpt3-175b", 8, 8, 2, "Et*12|" + "t*12|" * 6 + "t*12L"),
    "llama3-70b": _plan(
        "llama3-70b", 8, 4, 2, _chunked(9, 10, 6, 11), cp=2, virtual=2, schedule="interleaved-1f1b"
    ),
    "llama3-405b": _plan("llama3-405b", 8, 16, 1, _chunked(7, 8, 14, 7), cp=2, recompute="full"),
    "mixtral-8x7b": _plan("mixtral-8x7b", 1, 4, 8, "Et*8|t*8|t*8|t*8L", ep=8),
    "deepseek-v3": _plan("deepseek-v3", 1, 8, 16, _chunked(7, 8, 6, 6), ep=16),
    "fsdp": _plan("llama3-8b", 2, 2, 4, "Et*16|t*16L", optimizer_sharding="fsdp"),
}
ZBV = _plan("llama3-8b", 1, 4, 2, "Et*4|t*4|t*4|t*4|t*4|t*4|t*4|t*4L", virtual=2, schedule="zbv")


def megatron_layers(config) -> list[list[int]]:
    """The global layer indices Megatron-Core builds for each chunk c (rank c mod p, stage c // p)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, v = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    out = []
    try:
        for c in range(pp * v):
            rank, stage = c % pp, (c // pp if v > 1 else None)
            parallel_state.set_pipeline_model_parallel_rank(rank)
            first = get_transformer_layer_offset(config, stage, rank)
            out.append(list(range(first, first + get_num_layers_to_build(config, stage, rank))))
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return out
