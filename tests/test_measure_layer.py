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
