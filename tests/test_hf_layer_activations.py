"""The cost model's bytes for a ``transformers`` Llama decoder layer (``cost/layer_activations.py``)
(and ``train``'s size check, ``cost/activations.py``) against the tensors the layer's autograd graph
saves, storage by storage, on tiny layers built by ``--hf-model``: sdpa and eager attention,
grouped-query and multi-head, bf16 and fp32, and tensor parallelism."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from pipewright.cost.activations import runtime_layer_elements
from pipewright.cost.layer_activations import implementation_layer_bytes
from pipewright.errors import ConfigError
from pipewright.models.hf.build import build_stage, read_spec
from pipewright.models.hf.stage import attention_mask

S, H, A, F = 64, 128, 8, 352


def _spec(tmp_path, kv: int, attention: str | None):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": F,
        "num_hidden_layers": 1,
        "num_attention_heads": A,
        "num_key_value_heads": kv,
        "vocab_size": 256,
        "max_position_embeddings": S,
        "hidden_act": "silu",
    }
    if attention:
        config["attn_implementation"] = attention
    (tmp_path / "config.json").write_text(json.dumps(config))
    return read_spec(tmp_path, seq_len=S)


def _saved_bytes(spec, dtype: torch.dtype, b: int, linear_factory=None) -> int:
    """Bytes of the storages one layer's forward saves for its backward: neither parameters nor the
    stage's rotary tables (one pair a stage, shared by its layers); the layer's input when it is saved."""
    stage = build_stage(spec, None, 0, num_stages=1, linear_factory=linear_factory).to(dtype)
    layer = next(iter(stage.layers.values()))
    x = torch.randn(b, S, H, dtype=dtype, requires_grad=True)
    positions = torch.arange(S).unsqueeze(0)
    cos, sin = stage._rotary(x, positions)
    mask = attention_mask(stage.config, stage.types["0"], x, positions)
    skip = {p.untyped_storage()._cdata for p in layer.parameters()}
    skip |= {cos.untyped_storage()._cdata, sin.untyped_storage()._cdata}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in skip:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("attention", "kv"), [(None, 2), ("sdpa", 8), ("eager", 2)], ids=str)
def test_the_cost_models_bytes_are_what_the_transformers_layer_saves(tmp_path, attention, kv, dtype):
    spec = _spec(tmp_path, kv, attention)
    assert spec.layer_activations == f"hf-llama-{attention or 'sdpa'}"
    b, e = 2, torch.finfo(dtype).bits // 8
    saved = _saved_bytes(spec, dtype, b)
    assert saved == implementation_layer_bytes(spec, b, e, 1, "none")
    # train's size check counts the same layer (elements of e bytes, per s·b·h)
    elements = runtime_layer_elements(spec, "none", low_precision=e < 4)
    assert elements * b * S * H * e == pytest.approx(saved, rel=1e-12)


def test_selective_keeps_the_same_full_is_megatrons_count_and_an_unknown_set_is_one_line(tmp_path):
    spec = _spec(tmp_path, 2, None)
    none = implementation_layer_bytes(spec, 1, 2, 1, "none")
    assert implementation_layer_bytes(spec, 1, 2, 1, "selective") == none
    assert implementation_layer_bytes(spec, 1, 2, 1, "full") is None
    assert implementation_layer_bytes(replace(spec, layer_activations="megatron"), 1, 2, 1, "none") is None
    error = r"^unknown layer activation set 'hf-gpt'; choose one of: megatron, hf-llama-sdpa, "
    with pytest.raises(ConfigError, match=error):
        implementation_layer_bytes(replace(spec, layer_activations="hf-gpt"), 1, 2, 1, "none")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_with_tensor_parallelism_the_norms_are_replicated_and_the_rest_split(tmp_path, attention):
    """Rank 0 of t = 2 (pipewright's Megatron-style split of the projections; the ``fake`` process
    group's collectives complete at once, the shapes are the real ones)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pipewright.runtime.parallel.tp import tp_linear_factory

    spec = _spec(tmp_path, 2, attention)
    assert not dist.is_initialized()
    dist.init_process_group("cpu:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        saved = _saved_bytes(spec, torch.bfloat16, 2, tp_linear_factory(dist.group.WORLD))
    finally:
        dist.destroy_process_group()
    assert saved == implementation_layer_bytes(spec, 2, 2, 2, "none")
