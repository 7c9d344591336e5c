"""``cost/activations.py``'s count of what one layer of pipewright's own models keeps for the backward
(``runtime_layer_elements``, used by ``train``'s size check) against the tensors the layer's autograd
graph saves, counted storage by storage on tiny GPT and Llama layers."""

from __future__ import annotations

import pytest
import torch

from pipewright.cost.activations import runtime_layer_elements
from pipewright.models import gpt, llama_decoder
from pipewright.models.spec import ModelSpec
from pipewright.runtime.core.stage_recompute import apply_recompute

S, H = 128, 256


def _saved_units(spec: ModelSpec, mode: str) -> float:
    """Bytes of the storages one layer's forward saves (parameters aside) / (s·h·2 bytes)."""
    build = llama_decoder.build_stage if spec.family == "llama" else gpt.build_stage
    stage = build(spec, None, 0, num_stages=1).to(torch.bfloat16)
    apply_recompute(stage, mode)
    layer = next(iter(stage.layers.values()))
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    x = torch.randn(1, S, H, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values()) / (S * H * 2)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize(
    ("family", "ffn", "kv"), [("llama", 896, 2), ("llama", 1024, 8), ("gpt", 1024, 0)], ids=str
)
def test_the_runtime_count_is_what_the_layer_saves(family, ffn, kv, mode):
    spec = ModelSpec(
        name="tiny",
        family=family,
        layers=1,
        hidden=H,
        heads=8,
        seq_len=S,
        vocab=512,
        ffn_hidden=ffn,
        kv_heads=kv,
    )
    # beyond the count: the attention's row log-sum-exp (fp32) and the rotary tables, 0.3 units here
    assert _saved_units(spec, mode) == pytest.approx(runtime_layer_elements(spec, mode), abs=0.35)


def test_moe_layer_keeps_the_routers_16_bit_input_and_no_copy_for_the_combine():
    """The router's fp32 logits keep its 16-bit input (not an fp32 copy), and summing the weighted
    expert outputs into their tokens keeps only the indices: of [T·k, h] storages the layer keeps the
    dispatched tokens and the experts' outputs for the gate product, as Megatron's MoE does."""
    from dataclasses import replace

    from pipewright.models.presets import get_preset

    s, h = 64, 32
    spec = replace(get_preset("llama-moe-tiny"), seq_len=s, moe_dense_layers=0, moe_shared_experts=0)
    stage = llama_decoder.build_stage(spec, None, 0, num_stages=1).to(torch.bfloat16)
    layer = next(iter(stage.layers.values()))
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            saved[t.untyped_storage()._cdata] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True))
    routed = s * spec.moe_top_k * h * 2
    assert sum(1 for n, dt in saved.values() if n == routed and dt == torch.bfloat16) == 2
    assert not any(dt == torch.float32 and n >= s * h * 4 for n, dt in saved.values())
