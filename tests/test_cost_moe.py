"""cost/moe.py: mixture-of-experts terms against published parameter counts and the dense layer."""

import pytest

from pipewright.cost.layer import layer_forward_flops, layer_parameters, layer_stored_units
from pipewright.cost.moe import (
    MoE,
    all_to_all_bytes,
    all_to_all_time,
    expert_gemms,
    moe_layer_forward_flops,
    moe_layer_parameters,
    moe_model_parameters,
    moe_stored_units,
)
from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

MIXTRAL = ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 4096, ffn_hidden=14336, family="llama", kv_heads=8)
DENSE = ModelSpec("tiny", 2, 64, 4, 100, 16, ffn_hidden=176, family="llama", kv_heads=2)


def test_mixtral_total_and_activated_parameters_match_the_published_counts():
    """Mistral AI: Mixtral 8×7B has 46.7 × 10⁹ parameters, 12.9 × 10⁹ used per token."""
    moe = MoE(experts=8, top_k=2)
    assert moe_model_parameters(MIXTRAL, moe) == pytest.approx(46.7e9, rel=2e-3)
    assert moe_model_parameters(MIXTRAL, moe, activated=True) == pytest.approx(12.9e9, rel=3e-3)


def test_one_expert_top_one_is_the_dense_layer_plus_its_router():
    moe, b, h = MoE(experts=1, top_k=1), 3, DENSE.hidden
    assert moe_layer_parameters(DENSE, moe) == layer_parameters(DENSE) + h
    assert moe_layer_forward_flops(DENSE, moe, b) == layer_forward_flops(DENSE, b) + 2 * b * DENSE.seq_len * h
    # the dispatched copy of the MLP input (2·s·b·h), the expert's output kept for the gate product
    # (2·s·b·h) and the fp32 router probabilities (4·s·b), / t with sequence parallelism
    dense = layer_stored_units(DENSE, 2, True, scores=False)
    assert moe_stored_units(DENSE, moe, 2, True) == pytest.approx(dense + (2 + 2 + 4 / h) / 2)
    assert moe_stored_units(DENSE, moe) == pytest.approx(layer_stored_units(DENSE, scores=False) + 4 + 4 / h)


@pytest.mark.parametrize(
    ("experts", "top_k", "ep", "shared", "t"), [(8, 2, 1, 0, 1), (8, 2, 4, 0, 2), (64, 6, 8, 2, 4)]
)
def test_expert_gemms_over_the_group_do_the_experts_flops(experts, top_k, ep, shared, t):
    moe, tokens = MoE(experts=experts, top_k=top_k, shared=shared, capacity=1.25), 512
    gemms = expert_gemms(DENSE, moe, tokens, ep, t)
    per_device = t * sum(count * 2 * m * n * k for (m, n, k), count in gemms)
    h, f = DENSE.hidden, DENSE.ffn_hidden
    want = 2 * ep * tokens * (top_k * 1.25 + shared) * 3 * h * f  # swiglu: three matrices
    assert ep * per_device == pytest.approx(want)


def test_all_to_all_bytes_and_time():
    moe = MoE(experts=8, top_k=2, capacity=1.0)
    assert all_to_all_bytes(DENSE, moe, tokens=1000) == 1000 * 2 * 64 * 2
    assert all_to_all_time(8e6, 4, bandwidth=1e9, latency=1e-5) == pytest.approx(0.75 * 8e-3 + 3e-5)
    assert all_to_all_time(8e6, 1, bandwidth=1e9) == 0.0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MoE(experts=4, top_k=5), "top-k ≤ experts"),
        (lambda: expert_gemms(DENSE, MoE(experts=8), 16, ep=3), "must divide the 8 experts"),
        (lambda: MoE(experts=4, capacity=0), "capacity factor > 0"),
    ],
)
def test_bad_input_is_one_line(build, message):
    with pytest.raises(ConfigError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_fp8_keeps_the_expert_gemm_inputs_as_fp8_copies():
    moe = MoE(experts=8, top_k=2, shared=1, capacity=1.25)
    h, f = DENSE.hidden, DENSE.ffn_hidden
    slots = 2 * 1.25
    # the QKV and output-projection inputs, the dispatched copies and every expert's down input
    saved = 1 + 1 + slots + (slots + 1) * f / h
    assert moe_stored_units(DENSE, moe) - moe_stored_units(DENSE, moe, fp8=True) == pytest.approx(saved)
