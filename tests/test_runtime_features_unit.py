"""Training options, no processes: recomputation with the split backward in one process, the Llama model's
pieces (GQA, RoPE, parameter counts, presets), the cost model's Llama terms and activation accounting,
Hugging Face name maps, and the one-line errors and flags of the new training options."""

from __future__ import annotations

import argparse

import pytest
import torch

from pipewright.cli import train as train_cli
from pipewright.cost.activations import korthikanti_layer_bytes, runtime_layer_elements
from pipewright.cost.comm import Mesh
from pipewright.cost.llama import LlamaCost
from pipewright.errors import ConfigError
from pipewright.models.blocks import apply_rope, rope_tables
from pipewright.models.family import build_full, build_stage
from pipewright.models.gpt import loss_fn
from pipewright.models.hf_load import hf_name
from pipewright.models.presets import resolve_model
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import WeightGradStore, defer_weight_grads
from pipewright.runtime.checkpointing.fingerprint import fingerprint
from pipewright.runtime.core.precision import LossScaler
from pipewright.runtime.core.stage_recompute import apply_recompute, recomputed_modules
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import build_schedule
from pipewright.training import config_from_toml

LLAMA = ModelSpec("t", 2, 32, 4, 64, 16, family="llama", kv_heads=2, ffn_hidden=48)
GPT = ModelSpec("t", 2, 32, 4, 64, 16)


def _grads(spec: ModelSpec, mode: str, defer: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randint(0, spec.vocab, (2, spec.seq_len)), torch.randint(0, spec.vocab, (2, spec.seq_len))
    model = apply_recompute(build_full(spec, seed=1), mode)
    store = WeightGradStore()
    if defer:  # I now (recomputation happens here), W later from the store
        with defer_weight_grads(store, model, key=0):
            loss_fn(model(x), y).backward()
        assert len(store) > 0
        store.flush(0)
    else:
        loss_fn(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_under_split_backward_equals_none(spec, mode):
    want = _grads(spec, "none", defer=False)
    for defer in (False, True):
        got = _grads(spec, mode, defer)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=0)
    model = build_full(spec)
    assert len(recomputed_modules(model, mode)) == spec.layers  # one per layer (layer or its core)
    assert dict(model.state_dict()).keys() == dict(apply_recompute(model, mode).state_dict()).keys()


def test_llama_parameters_and_presets():
    model = build_full(LLAMA)
    assert sum(p.numel() for p in model.parameters()) == LLAMA.num_parameters()
    assert all("bias" not in n for n, _ in model.named_parameters())
    sizes = {
        n: round(resolve_model(n).num_parameters() / 1e9, 1)
        for n in ("llama3-8b", "llama3-70b", "llama3-405b")
    }
    assert sizes == {"llama3-8b": 8.0, "llama3-70b": 70.6, "llama3-405b": 405.9}
    spec = resolve_model("llama3-8b")
    assert (spec.kv_heads, spec.ffn_hidden, spec.vocab) == (8, 14336, 128256)
    cost = LlamaCost(spec, mesh=Mesh(pp=4))
    assert cost.parameters(build_schedule("1f1b", 4, 8)) == pytest.approx(spec.num_parameters())


def test_llama_stages_compose_to_the_full_model():
    x = torch.randint(0, LLAMA.vocab, (2, LLAMA.seq_len))
    with torch.no_grad():
        want = build_full(LLAMA, seed=3)(x)
        h = build_stage(LLAMA, None, 0, seed=3, num_stages=2)(x)
        got = build_stage(LLAMA, None, 1, seed=3, num_stages=2)(h)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """With kv heads repeated into a full set of heads, GQA is multi-head attention."""
    mha = LLAMA.with_overrides(kv_heads=4)
    gqa_model, mha_model = build_full(LLAMA, seed=2), build_full(mha, seed=2)
    state = gqa_model.state_dict()
    d = LLAMA.head_dim
    for i in range(LLAMA.layers):
        for w in ("k", "v"):
            key = f"layers.{i}.attn.{w}.weight"
            state[key] = state[key].view(2, d, -1).repeat_interleave(2, dim=0).reshape(4 * d, -1)
    mha_model.load_state_dict(state)
    x = torch.randint(0, LLAMA.vocab, (2, LLAMA.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(gqa_model(x), mha_model(x), rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
    cos, sin = rope_tables(32, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(p: int, r: int) -> float:
        qp = apply_rope(q.view(1, 1, 1, 8), cos[p : p + 1], sin[p : p + 1])
        kr = apply_rope(k.view(1, 1, 1, 8), cos[r : r + 1], sin[r : r + 1])
        return float((qp * kr).sum())

    assert score(5, 2) == pytest.approx(score(20, 17), rel=1e-5)
    assert score(3, 3) == pytest.approx(float(q @ k), rel=1e-5)


def test_activation_accounting_orders_modes():
    for spec in (GPT, LLAMA, resolve_model("llama3-8b")):
        kept = [runtime_layer_elements(spec, m) for m in ("none", "selective", "full")]
        # with fused attention selective drops no s·h tensor (only the core's row log-sum-exp)
        assert kept[0] == kept[1] > kept[2] == 1
    spec = resolve_model("gpt3-175b")
    s, b, h, a = spec.seq_len, 1, spec.hidden, spec.heads
    assert korthikanti_layer_bytes(spec, b, "none") == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(spec, b, "selective") == pytest.approx(34 * s * b * h)
    assert korthikanti_layer_bytes(spec, b, "full") == 2 * s * b * h
    full = LlamaCost(resolve_model("llama3-8b"), recompute="full", mesh=Mesh(pp=2))
    none = LlamaCost(resolve_model("llama3-8b"), recompute="none", mesh=Mesh(pp=2))
    sched = build_schedule("1f1b", 2, 4)
    from pipewright.ir import Action, B, F

    f, bw = Action(0, F, 0), Action(0, B, 0)
    assert full.activation_bytes(f, sched) < none.activation_bytes(f, sched) / 10
    assert full.flops(bw, sched) == pytest.approx(none.flops(bw, sched) + none.flops(f, sched))


def test_hf_names():
    assert hf_name("layers.3.attn.qkv.weight", "gpt") == ("h.3.attn.c_attn.weight", True)
    assert hf_name("layers.3.attn.qkv.bias", "gpt") == ("h.3.attn.c_attn.bias", False)
    assert hf_name("head.norm.bias", "gpt") == ("ln_f.bias", False)
    assert hf_name("layers.0.mlp.gate.weight", "llama") == ("model.layers.0.mlp.gate_proj.weight", False)
    assert hf_name("embed.tok.weight", "llama") == ("model.embed_tokens.weight", False)


def test_loss_scaler_halves_on_overflow_and_grows():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 4.0 and scaler.skipped == 1
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 8.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"recompute": "some"}, "--recompute must be one of none, selective, full"),
        ({"precision": "fp8"}, "--precision must be one of fp32, bf16, fp16"),
        ({"shard_optimizer": True}, "--shard-optimizer shards over data parallelism"),
        ({"reduce_fp32": True}, "--reduce-fp32 is for --precision bf16/fp16"),
        ({"init_from": "/nonexistent"}, "no config.json"),
        ({"init_from": "/x", "layers": 2}, "drop --layers"),
    ],
)
def test_impossible_combinations_are_one_line_errors(values, message):
    with pytest.raises(ConfigError, match=message) as info:
        TrainConfig(**values).check()
    assert "\n" not in str(info.value)


def test_model_errors():
    with pytest.raises(ConfigError, match="needs --model llama"):
        TrainConfig(kv_heads=2).model_spec(256)
    with pytest.raises(ConfigError, match="--kv-heads 2 is not divisible by --tp 4"):
        TrainConfig(model="llama-tiny", tp=4, vocab=256).model_spec(256)
    with pytest.raises(ConfigError, match="not divisible by --kv-heads 3"):
        TrainConfig(model="llama-tiny", kv_heads=3).model_spec(256)


def test_flags_and_toml_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    train_cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["train", "--recompute", "full", "--precision", "bf16", "--shard-optimizer", "--tie-embeddings",
         "--model", "llama", "--kv-heads", "2", "--reduce-fp32", "--dp", "2"]
    )  # fmt: skip
    config = train_cli.config_from_args(args)
    assert (config.recompute, config.precision, config.model, config.kv_heads) == ("full", "bf16", "llama", 2)
    assert config.shard_optimizer and config.tie_embeddings and config.reduce_fp32
    path = tmp_path / "run.toml"
    path.write_text('[train]\nrecompute = "selective"\nprecision = "fp16"\ntie-embeddings = true\n')
    config = config_from_toml(path)
    assert (config.recompute, config.precision, config.tie_embeddings) == ("selective", "fp16", True)
    assert config.model_spec(256).tied_embeddings


def test_gpt_fingerprint_unchanged_by_llama_fields():
    spec = TrainConfig().model_spec(256)
    assert fingerprint(spec, "byte") == fingerprint(spec.with_overrides(rope_theta=1.0), "byte")
    llama = TrainConfig(model="llama-tiny").model_spec(256)
    assert fingerprint(llama, "byte") != fingerprint(llama.with_overrides(kv_heads=4), "byte")
