"""The mixture-of-experts layer and its options without processes: routing, capacity, the auxiliary
losses' gradient, parameter counts against the published totals, layout-independent expert weights,
the ep dimension of the mesh, and bad input refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.cli import main
from pipewright.data.tokens import write_tokens
from pipewright.errors import ConfigError
from pipewright.mesh import Mesh
from pipewright.models.family import build_full, build_stage
from pipewright.models.moe_mlp import MoE, moe_layers, route
from pipewright.models.presets import get_preset, resolve_model
from pipewright.runtime.setup.config import TrainConfig


def test_route_keeps_top_k_and_drops_over_capacity():
    # 8 tokens, all preferring expert 0 then 1: capacity ⌈1.0·8·2/4⌉ = 4 keeps the first 4 of each
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(8, 1)
    expert, token, gate, kept, balance = route(logits, 2, 1.0)
    assert expert.tolist() == [0, 1] * 8 and token.tolist() == [t for t in range(8) for _ in (0, 1)]
    assert kept.tolist() == [True] * 8 + [False] * 8
    p = logits[0].softmax(-1)
    assert torch.allclose(gate[:2], p[:2] / p[:2].sum())  # renormalised over the top 2
    # f = (1/2, 1/2, 0, 0), P = p: balance = E·Σ fᵢPᵢ
    assert math.isclose(float(balance), 4 * 0.5 * float(p[0] + p[1]), rel_tol=1e-6)
    assert route(logits, 2, 0.0)[3].all()  # dropless


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 12))
@settings(max_examples=30, deadline=None)
def test_balance_is_one_when_routing_and_probabilities_are_uniform(experts, k, tokens):
    k = min(k, experts)
    balance = route(torch.zeros(tokens, experts), k, 0.0)[4]
    # uniform probabilities: Pᵢ = 1/E whatever the counts, so E·Σ fᵢ/E = Σ fᵢ = 1
    assert math.isclose(float(balance), 1.0, rel_tol=1e-6)


def test_aux_loss_gradient_is_scale_times_its_derivative():
    spec = get_preset("gpt-moe-tiny").with_overrides(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05)
    a, b = (build_full(spec, seed=3) for _ in range(2))
    x = torch.randn(2, 16, spec.hidden)
    w = torch.randn(2, 16, spec.hidden)
    layer_a, layer_b = moe_layers(a)[0], moe_layers(b)[0]
    layer_a.aux_grad_scale, layer_b.aux_grad_scale = 0.25, 0.0
    (layer_a(x) * w).sum().backward()
    logits = torch.nn.functional.linear(x.reshape(-1, spec.hidden), layer_b.router.weight)
    balance = route(logits, spec.moe_top_k, 0.0)[4]
    z = torch.logsumexp(logits, -1).pow(2).mean()
    ((layer_b(x) * w).sum() + 0.25 * (0.3 * balance + 0.05 * z)).backward()
    for (name, pa), pb in zip(layer_a.named_parameters(), layer_b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-8), name
    assert layer_a.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["gpt-moe-tiny", "llama-moe-tiny"])
def test_parameter_count_matches_the_model(name):
    spec = get_preset(name)
    model = build_full(spec)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    layer = moe_layers(model)[-1]
    per_expert = sum(p.numel() for p in layer.experts["0"].parameters())
    assert spec.num_parameters() - spec.activated_parameters() == spec.moe_layers * per_expert * (
        spec.moe_experts - spec.moe_top_k
    )


def test_published_sizes():
    mixtral, dsv3 = get_preset("mixtral-8x7b"), get_preset("deepseek-v3")
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Jiang et al. 2024)
    assert round(mixtral.num_parameters() / 1e9, 1) == 46.7
    assert round(mixtral.activated_parameters() / 1e9, 1) == 12.9
    # DeepSeek-V3: 671B total, 37B activated; ordinary attention here instead of MLA: within 1% / 5%
    assert dsv3.moe_layers == 58 and abs(dsv3.num_parameters() / 671e9 - 1) < 0.01
    assert abs(dsv3.activated_parameters() / 37e9 - 1) < 0.05


class _FakeExchange:
    size, rank = 2, 1


def test_expert_weights_do_not_depend_on_which_experts_a_rank_holds():
    spec = get_preset("llama-moe-tiny")
    full = dict(build_full(spec, seed=5).named_parameters())
    stage = build_stage(spec, None, 1, seed=5, num_stages=2, expert_parallel=_FakeExchange())
    names = dict(stage.named_parameters())
    assert any(".experts.3." in n for n in names) and not any(".experts.0." in n for n in names)
    for name, p in names.items():
        assert torch.equal(p, full[name]), name
    assert all(isinstance(m.mlp, MoE) == (int(i) >= 1) for i, m in build_full(spec).layers.items())


def test_mesh_carves_ep_from_dp():
    mesh = Mesh(tp=2, pp=2, dp=4, ep=2)
    for r in range(mesh.size):
        ep, edp = mesh.ep_group(r), mesh.expert_dp_group(r)
        assert r in ep and r in edp and len(ep) == 2 and len(edp) == 2
        assert set(ep) & set(edp) == {r}
        assert {mesh.coords(q)[:2] for q in ep + edp} == {mesh.coords(r)[:2]}  # same tp, pp
        assert [mesh.coords(q).dp for q in ep] == [mesh.coords(r).dp // 2 * 2 + i for i in range(2)]
    assert sorted(sum(mesh.ep_groups(), ())) == list(range(mesh.size))
    assert sorted(sum(mesh.expert_dp_groups(), ())) == list(range(mesh.size))


def test_expert_dp_cp_group_is_the_expert_replicas_over_every_cp_rank():
    """The experts' gradient group with context parallelism: the expert-dp ranks × every cp rank (one
    all-reduce for both), a partition of the world, each group one (tp, pp) and one ep rank."""
    mesh = Mesh(tp=2, pp=1, dp=4, ep=2, cp=2)
    for r in range(mesh.size):
        me = mesh.coords(r)
        dps = [mesh.coords(q).dp for q in mesh.expert_dp_group(r)]
        want = {mesh.rank(tp=me.tp, pp=me.pp, dp=d, cp=c) for d in dps for c in range(2)}
        assert set(mesh.expert_dp_cp_group(r)) == want and len(want) == 4
        assert {mesh.ep_rank(q) for q in want} == {mesh.ep_rank(r)}
    assert sorted(sum(mesh.expert_dp_cp_groups(), ())) == list(range(mesh.size))


def _spec_error(**values) -> str:
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{"model": "gpt-moe-tiny", "pp": 2, **values}).model_spec(256)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input_is_one_line():
    assert "--moe-experts 6 is not divisible by --ep 4" in _spec_error(dp=4, ep=4, moe_experts=6)
    assert "--ep 2 must divide --dp 3" in _spec_error(dp=3, ep=2)
    assert "--moe-top-k 5 must be between 1 and --moe-experts 4" in _spec_error(moe_top_k=5)
    assert "add --moe-experts" in _spec_error(model="gpt-tiny", dp=2, ep=2)
    assert "--sequence-parallel" in _spec_error(tp=2, sequence_parallel=True)
    assert "--shard-optimizer" in _spec_error(dp=2, ep=2, shard_optimizer=True)
    assert "--moe-capacity 1 with --cp 2 would cap each cp rank's own tokens" in _spec_error(
        cp=2, moe_capacity=1.0
    )
    TrainConfig(model="gpt-moe-tiny", pp=2, cp=2).model_spec(256)  # dropless experts run under cp
    with pytest.raises(ConfigError, match="must divide --dp 3"):
        Mesh(dp=3, ep=2)
    with pytest.raises(ConfigError, match="between 1 and --moe-experts 2"):
        resolve_model("gpt", layers=2, hidden=16, heads=2, vocab=64, seq_len=8, moe_experts=2, moe_top_k=3)


def test_train_flags(capsys, tmp_path):
    data = tmp_path / "tokens.bin"
    write_tokens(data, np.arange(4096) % 256, vocab_size=256)
    argv = ["train", "--model", "gpt-moe-tiny", "--pp", "2", "--dp", "2", "--ep", "2", "--data", str(data)]
    argv += ["--out", str(tmp_path / "run")]
    assert main([*argv, "--moe-experts", "3", "--dry-run"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == "pipewright: error: --moe-experts 3 is not divisible by --ep 2; choose ep dividing it"
    config = TrainConfig(model="gpt-moe-tiny", moe_top_k=1, moe_capacity=1.25, moe_shared_experts=2)
    spec = config.model_spec(256)
    assert (spec.moe_experts, spec.moe_top_k, spec.moe_capacity, spec.moe_shared_experts) == (4, 1, 1.25, 2)


def test_rank_labels_name_the_ep_and_cp_coordinates():
    # tp-cp-dp-pp at cp 2, pp 2, dp 2 with ep 2: rank = c + 2·(d + 2·p)
    from pipewright.runtime.reliability.hang import mesh_rank_label

    layout = Mesh(1, 2, 2, "tp-cp-dp-pp", cp=2, ep=2)
    assert mesh_rank_label(layout, 0) == "rank 0 (pp 0, dp 0, ep 0, cp 0)"
    assert mesh_rank_label(layout, 7) == "rank 7 (pp 1, dp 1, ep 1, cp 1)"
    assert mesh_rank_label(Mesh(2, 2, 1), 3) == "rank 3 (pp 1, tp 1)"
    # a placement: the process on device 0 holds global rank 1's coordinates
    assert mesh_rank_label(Mesh(1, 2, 1, placement=(1, 0)), 0) == "rank 0 (pp 1)"


def test_process_count_messages_count_cp():
    from pipewright.training import prepare

    with pytest.raises(ConfigError, match=r"tp × cp × pp × dp = 1×2×2×1 = 4 but there are 2 processes"):
        prepare(TrainConfig(model="gpt-tiny", pp=2, cp=2), world_size=2)
