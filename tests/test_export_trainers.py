"""Exports of large-model plans read by the trainers' own code: GPT-3 175B, Llama 3 70B (uneven
interleaved chunks, cp) and 405B (uneven, cp), Mixtral 8×7B (ep 8), DeepSeek-V3 (256 experts, dense
first layers, shared expert, latent attention, multi-token prediction, ep 16), an FSDP plan and a ZB-V
plan (refused for Megatron-LM, whose chunk c sits on rank c mod p).

Megatron-LM: Megatron-LM's own ``arguments.py`` is not on PyPI (megatron-core 0.16.1 ships
``megatron.core`` only; megatron-bridge 0.3.1 needs Transformer Engine, which has no CPU build, and
transformers < 5), so the flags are turned into Megatron-Core's ``TransformerConfig`` /
``MLATransformerConfig`` the way ``core_transformer_config_from_args`` does (same-named fields, plus
its renames: num_experts → num_moe_experts, --swiglu → gated_linear_unit, kv groups only with
--group-query-attention) and that class's own checks run; the per-rank layers are Megatron-Core's
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` for every (pipeline rank, virtual
stage). torchtitan 0.2.2: its ``ConfigManager`` parses the TOML; the flavor's model arguments come from
its own flavor tables (``llama3_args``, ``deepseekv3_args``) and the per-stage modules from its
``generate_llm_fqn_per_model_part``. torchtitan's models package imports ``triton`` (its MoE kernels
module, decorated with ``@triton.jit``) which CPU builds of torch do not ship: the test installs a
stand-in ``triton`` module whose decorators return the function unchanged; no kernel is called."""

from __future__ import annotations

import shlex
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _export_flags import megatron_flags as _flags
from _export_plans import PLANS, ZBV, megatron_layers
from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.models.presets import get_preset
from pipewright.plan.export import chunks
from pipewright.plan.export_megatron import megatron_args
from pipewright.plan.planfile import Plan, check_schema, load, save


def _megatron_config(flags: dict[str, object]):
    """Megatron-Core's TransformerConfig from the flags (``core_transformer_config_from_args``'s
    rule) and the virtual pipeline size Megatron-LM's ``validate_args`` derives."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    cls = MLATransformerConfig if flags.get("multi_latent_attention") else TransformerConfig
    kw = {k: v for k, v in flags.items() if k in cls.__dataclass_fields__}
    kw["num_moe_experts"] = flags.get("num_experts")
    kw["num_query_groups"] = flags["num_query_groups"] if flags.get("group_query_attention") else None
    kw["add_bias_linear"] = flags.get("bias_linear", True)
    if flags.get("swiglu"):
        kw |= {"activation_func": F.silu, "gated_linear_unit": True}
    if "moe_layer_freq" in flags:  # Megatron-LM's moe_freq_type: a Python list expression
        kw["moe_layer_freq"] = eval(flags["moe_layer_freq"])
    pp, layers = flags["pipeline_model_parallel_size"], flags["num_layers"]
    v = None
    if "pipeline_model_parallel_layout" in flags:
        layout = PipelineParallelLayerLayout(flags["pipeline_model_parallel_layout"], pp)
        kw["pipeline_model_parallel_layout"] = layout
        v = layout.virtual_pipeline_model_parallel_size
    elif "num_layers_per_virtual_pipeline_stage" in flags:
        v = layers // pp // flags["num_layers_per_virtual_pipeline_stage"]
    kw["virtual_pipeline_model_parallel_size"] = v if v and v > 1 else None
    return cls(**kw, pipeline_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", PLANS)
def test_megatron_builds_the_plans_model_and_layout(name: str) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]')")
    plan = Plan(PLANS[name])
    spec, flags = get_preset(plan["model"]["name"]), _flags(megatron_args(plan))
    config = _megatron_config(flags)  # its __post_init__ checks the combination
    ep = plan.data.get("ep", 1)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (
        spec.layers,
        spec.hidden,
        spec.heads,
    )
    assert (config.num_query_groups or config.num_attention_heads) == spec.kv_heads
    assert config.ffn_hidden_size == spec.ffn_hidden
    assert config.normalization == ("RMSNorm" if spec.family == "llama" else "LayerNorm")
    assert config.gated_linear_unit == (spec.mlp == "swiglu") and config.add_bias_linear == spec.bias
    assert flags["position_embedding_type"] == ("rope" if spec.family == "llama" else "learned_absolute")
    if spec.family == "llama":
        assert flags["rotary_base"] == spec.rope_theta
    assert flags.get("untie_embeddings_and_output_weights", False) == (not spec.tied_embeddings)
    # Megatron-LM's _vocab_size_with_padding: up to a multiple of make-vocab-size-divisible-by · tp
    multiple = flags["make_vocab_size_divisible_by"] * config.tensor_model_parallel_size
    assert -(-flags["vocab_size"] // multiple) * multiple == plan.padded_vocab
    assert (config.num_moe_experts or 0) == spec.moe_experts
    if spec.is_moe:
        assert (config.moe_router_topk, config.moe_ffn_hidden_size) == (spec.moe_top_k, spec.expert_ffn)
        assert config.expert_model_parallel_size == ep
        assert config.moe_aux_loss_coeff == spec.moe_aux_loss_coeff
        freq = config.moe_layer_freq
        moe = [bool(freq[i]) if isinstance(freq, list) else i % freq == 0 for i in range(spec.layers)]
        assert moe == [spec.is_moe_layer(i) for i in range(spec.layers)]
        shared = config.moe_shared_expert_intermediate_size or 0
        assert shared == spec.moe_shared_experts * spec.expert_ffn
    assert (config.mtp_num_layers or 0) == spec.mtp_depth
    if spec.attention_kind == "mla":
        assert config.multi_latent_attention and config.kv_lora_rank == 512
    assert (config.tensor_model_parallel_size, config.context_parallel_size) == (
        plan["tp"],
        plan.data.get("cp", 1),
    )
    assert megatron_layers(config) == [list(c.layers) for c in chunks(plan)]
    if plan.data.get("optimizer_sharding") == "fsdp":  # Megatron-LM's check for Megatron-FSDP
        assert flags["use_megatron_fsdp"] and flags["ckpt_format"] == "fsdp_dtensor"


def test_megatron_refuses_a_v_shaped_plan() -> None:
    with pytest.raises(ConfigError, match="places chunks in a V, which Megatron-LM cannot run"):
        megatron_args(Plan(ZBV))


@pytest.fixture(scope="module")
def titan():
    """torchtitan 0.2.2's config manager, flavor tables and stage split (module docstring: triton)."""
    if "triton" not in sys.modules:
        import torch._dynamo
        import torch._inductor.compile_fx  # noqa: F401

        triton = types.ModuleType("triton")
        language = types.ModuleType("triton.language")
        language.constexpr, language.dtype = int, type("dtype", (), {})
        triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda g: g)
        triton.autotune = lambda *_, **__: lambda g: g
        triton.Config, triton.cdiv, triton.language = (
            (lambda *_, **__: None),
            (lambda a, b: -(-a // b)),
            language,
        )
        sys.modules |= {"triton": triton, "triton.language": language}
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
        from torchtitan.models.deepseek_v3 import deepseekv3_args
        from torchtitan.models.llama3 import llama3_args
    except ImportError as exc:
        pytest.skip(f"torchtitan does not import here: {exc}")
    return types.SimpleNamespace(
        manager=ConfigManager,
        split=generate_llm_fqn_per_model_part,
        flavors={"llama3": llama3_args, "deepseek_v3": deepseekv3_args},
    )


@pytest.mark.parametrize("name", [*PLANS, "zbv"])
def test_torchtitan_builds_the_plans_model_and_layout(name: str, titan, tmp_path: Path) -> None:
    data = ZBV if name == "zbv" else PLANS[name]
    save(data, tmp_path / "plan.json")
    toml = tmp_path / "plan.toml"
    assert main(["export-plan", str(tmp_path / "plan.json"), "--to", "torchtitan", "-o", str(toml)]) == 0
    job, plan = titan.manager().parse_args(["--job.config_file", str(toml)]), load(tmp_path / "plan.json")
    spec = get_preset(plan["model"]["name"])
    if job.model.flavor not in titan.flavors.get(job.model.name, {}):  # GPT-3, Mixtral: none in 0.2.2
        assert job.model.flavor == spec.name  # a flavor torchtitan refuses, not its debug model
        assert "(torchtitan refuses it until then)" in toml.read_text()
    else:
        args = titan.flavors[job.model.name][job.model.flavor]
        assert (args.n_layers, args.dim, args.n_heads, args.vocab_size) == (
            spec.layers,
            spec.hidden,
            spec.heads,
            spec.vocab,
        )
        assert (getattr(args, "n_kv_heads", None) or args.n_heads) == spec.kv_heads
        assert args.rope_theta == spec.rope_theta
        if spec.is_moe:
            moe = args.moe_args
            assert (moe.num_experts, moe.top_k, args.n_dense_layers) == (
                spec.moe_experts,
                spec.moe_top_k,
                spec.moe_dense_layers,
            )
    par = job.parallelism
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree) == (
        plan["tp"],
        plan["pp"],
        plan.data.get("cp", 1),
    )
    assert par.expert_parallel_degree == plan.data.get("ep", 1)
    stages = plan["pp"] * plan.data.get("virtual", 1)  # torchtitan's pipeline_llm, layers_per_stage given
    first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    parts = par.module_fqns_per_model_part or titan.split(stages, spec.layers, first, last)
    assert [[int(m.split(".")[1]) for m in p if m.startswith("layers.")] for p in parts] == [
        list(c.layers) for c in chunks(plan)
    ]
    if name == "zbv":
        assert par.pipeline_parallel_schedule == "ZBVZeroBubble"


def test_an_older_plan_file_takes_the_preset_and_says_so(tmp_path: Path, capsys) -> None:
    old = dict(PLANS["mixtral-8x7b"])
    old["model"] = {k: v for k, v in old["model"].items() if not k.startswith("moe_") and k != "family"}
    save(old, tmp_path / "old.json")
    assert main(["export-plan", str(tmp_path / "old.json"), "--to", "megatron"]) == 0
    text = capsys.readouterr().out
    assert "# note: the plan file does not record family" in text and "preset mixtral-8x7b" in text
    body = text[text.index("MEGATRON_ARGS=(") + len("MEGATRON_ARGS=(") : text.rindex(")")]
    assert _flags(shlex.split(body))["num_experts"] == 8


@settings(max_examples=40, deadline=None)
@given(
    key=st.sampled_from(
        ["family", "tied_embeddings", "rope_theta", "moe_experts", "moe_top_k", "moe_capacity"]
    ),
    value=st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.floats(-2, 2)),
)
def test_plan_files_check_the_architecture_fields(key: str, value: object) -> None:
    """A plan file's architecture field of the wrong type is one line naming it; a right one loads."""
    data = {**PLANS["mixtral-8x7b"], "model": {**PLANS["mixtral-8x7b"]["model"], key: value}}
    valid = {
        "family": value in ("gpt", "llama", "bert"),
        "tied_embeddings": isinstance(value, bool),
        "rope_theta": isinstance(value, int | float) and not isinstance(value, bool) and value > 0,
        "moe_experts": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        "moe_top_k": isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        "moe_capacity": isinstance(value, int | float) and not isinstance(value, bool) and value >= 0,
    }[key]
    if valid:
        check_schema(data)
    else:
        with pytest.raises(ConfigError, match=rf'^plan: "model\.{key}" must be [^\n]+$'):
            check_schema(data)


def test_a_device_order_is_a_note(tmp_path: Path, capsys) -> None:
    place = [1, 0, *range(2, 16)]
    save({**PLANS["fsdp"], "placement": place}, tmp_path / "placed.json")
    for target in ("megatron", "torchtitan"):
        assert main(["export-plan", str(tmp_path / "placed.json"), "--to", target]) == 0
        assert "# note: the plan places global rank g (order tp-dp-pp) on device placement[g] = 1,0,2," in (
            capsys.readouterr().out
        )
