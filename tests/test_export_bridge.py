"""Exports read by Megatron-Bridge 0.3.1's own code (the README's test command installs it with ``--no-deps``;
omegaconf and six come with the test extra): each plan of tests/_export_plans.py exported ``--to bridge``
is run as Bridge users run a recipe override (``apply_plan(gpt3_175b_pretrain_config())``),
``ConfigContainer.validate()`` accepts it at the plan's world size and derives the plan's dp, its model
provider is the plan's model field by field, and Megatron-Core's per-rank layer assignment of that
provider is the plan's layout. The same plans' Megatron-LM flags go through Bridge's copy of Megatron-LM's
``core_transformer_config_from_args``
(``megatron.bridge.training.mlm_compat.arguments._transformer_config_from_args``) and give the same model.

Megatron-LM's ``parse_args``/``validate_args`` are in no PyPI package (megatron-core ships
``megatron.core``; megatron-bridge carries only the namespace → ``TransformerConfig`` step), so the
namespace is built here from the flags: the flag names Megatron-Core's config dataclasses declare
(``argparse_meta``), ``--disable-x`` false, Megatron-LM's parser defaults for what the export does not
give, and ``validate_args``'s ``params_dtype``/``moe_layer_freq`` steps.

Stand-ins (why each: :data:`STAND_INS`): megatron-bridge 0.3.1 requires Transformer
Engine and mamba-ssm (CUDA builds only) and transformers < 5, so it is installed without its dependencies,
and five modules it imports at import time are empty stand-ins, put in ``sys.modules`` by the fixture only
while Bridge is imported and removed after: no stand-in is called by the code under test. Megatron-Core's
GPT modules are imported first, so they see Transformer Engine absent, as on any CPU machine (the test
checks ``HAVE_TE`` is false where the layer specs are chosen)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import types
from pathlib import Path

import pytest

from _export_flags import megatron_flags
from _export_plans import PLANS, ZBV, megatron_layers
from _stand_ins import missing, stand_ins
from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.models.presets import get_preset
from pipewright.plan.export import chunks
from pipewright.plan.export_bridge import bridge_text
from pipewright.plan.export_megatron import megatron_args, plan_world
from pipewright.plan.planfile import Plan, save

#: module → why an empty stand-in is put there while Bridge is imported.
STAND_INS = {
    "transformer_engine": "Bridge's LoRA layers (megatron/bridge/peft/lora_layers.py) and its rotary "
    "helpers import transformer_engine.pytorch at module level; Transformer Engine has no CPU build",
    "mamba_ssm": "Bridge's Mamba provider imports Megatron-Core's mamba_mixer, which imports mamba-ssm's "
    "Triton kernels (a CUDA build)",
    "triton": "the same import reaches Megatron-Core's inference tensor ops, which import triton; CPU "
    "builds of torch do not ship it",
    "megatron.energon": "Bridge's recipes package imports its multimodal data modules, which import "
    "megatron-energon (not a Bridge dependency; not used by a GPT config)",
    "modelopt": "Bridge's training setup imports its checkpointing module, which imports nvidia-modelopt's "
    "save/restore plugins at module level (a megatron-core[dev] dependency; no checkpoint is written here)",
}
#: Megatron-Core modules imported before the stand-ins, so that they see Transformer Engine absent.
_CORE_FIRST = (
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.post_training.modelopt.layers",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.multi_token_prediction",
)


@pytest.fixture(scope="module")
def bridge():
    """Megatron-Bridge's config container, GPT-3 recipe and Megatron-LM translation (module
    docstring: the stand-ins)."""
    if importlib.util.find_spec("megatron.bridge") is None:
        missing(
            "megatron-bridge is not installed: pip install -c constraints.txt --no-deps megatron-bridge "
            "(README's test command)"
        )
    if importlib.util.find_spec("omegaconf") is None:
        missing("Megatron-Bridge needs omegaconf, which the test extra installs (README's test command)")
    for name in _CORE_FIRST:
        __import__(name)
    with stand_ins(STAND_INS):
        from megatron.bridge.recipes.gpt.gpt3_175b import gpt3_175b_pretrain_config
        from megatron.bridge.training.mlm_compat.arguments import _transformer_config_from_args
        from megatron.bridge.training.setup import _validate_and_set_vocab_size
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.transformer_block as block

    assert not specs.HAVE_TE and not block.HAVE_TE  # Megatron-Core saw no stand-in
    return types.SimpleNamespace(
        recipe=gpt3_175b_pretrain_config,
        from_args=_transformer_config_from_args,
        vocab=_validate_and_set_vocab_size,
    )


def _run_export(text: str, tmp_path: Path) -> types.ModuleType:
    """The exported module, imported as a user's script imports it."""
    path = tmp_path / "plan_bridge.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("plan_bridge", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_plans_model(config, plan: Plan) -> None:
    """The config is the plan's model, field by field (layers, hidden, heads, kv, ffn, vocabulary,
    norm, activation, bias, experts, top-k, shared experts, dense layers, latent attention, MTP)."""
    spec = get_preset(plan["model"]["name"])
    got = (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size)
    assert got == (spec.layers, spec.hidden, spec.heads, spec.ffn_hidden)
    assert (config.num_query_groups or config.num_attention_heads) == spec.kv_heads
    assert config.normalization == ("RMSNorm" if spec.family == "llama" else "LayerNorm")
    assert config.gated_linear_unit == (spec.mlp == "swiglu") and config.add_bias_linear == spec.bias
    assert config.activation_func.__name__ == {"swiglu": "silu", "gelu": "gelu"}[spec.mlp]
    assert (config.num_moe_experts or 0) == spec.moe_experts
    if spec.is_moe:
        assert (config.moe_router_topk, config.moe_ffn_hidden_size) == (spec.moe_top_k, spec.expert_ffn)
        assert config.expert_model_parallel_size == plan.data.get("ep", 1)
        assert config.moe_aux_loss_coeff == spec.moe_aux_loss_coeff
        freq = config.moe_layer_freq
        moe = [bool(freq[i]) if isinstance(freq, list) else i % freq == 0 for i in range(spec.layers)]
        assert moe == [spec.is_moe_layer(i) for i in range(spec.layers)]
        assert (config.moe_shared_expert_intermediate_size or 0) == spec.moe_shared_experts * spec.expert_ffn
    assert (config.mtp_num_layers or 0) == spec.mtp_depth
    assert bool(config.multi_latent_attention) == (spec.attention_kind == "mla")
    degrees = (config.tensor_model_parallel_size, config.context_parallel_size)
    assert (*degrees, config.pipeline_model_parallel_size) == (plan["tp"], plan.data.get("cp", 1), plan["pp"])
    assert megatron_layers(config) == [list(c.layers) for c in chunks(plan)]


@pytest.mark.parametrize("name", PLANS)
def test_bridge_validates_the_plans_model_and_layout(name: str, bridge, tmp_path: Path, monkeypatch) -> None:
    save(PLANS[name], tmp_path / "plan.json")
    out = tmp_path / "plan_bridge.py"
    assert main(["export-plan", str(tmp_path / "plan.json"), "--to", "bridge", "-o", str(out)]) == 0
    plan = Plan(PLANS[name])
    spec = get_preset(plan["model"]["name"])
    cfg = _run_export(out.read_text(), tmp_path).apply_plan(bridge.recipe())
    cfg.checkpoint.save = cfg.checkpoint.load = str(tmp_path / "ckpt")  # the format checks apply
    monkeypatch.setenv("WORLD_SIZE", str(plan_world(plan)))
    cfg.validate()
    assert cfg.data_parallel_size == plan["dp"]
    model = cfg.model
    _assert_plans_model(model, plan)
    assert model.position_embedding_type == ("rope" if spec.family == "llama" else "learned_absolute")
    if spec.family == "llama":
        assert model.rotary_base == spec.rope_theta
    assert model.share_embeddings_and_output_weights == spec.tied_embeddings
    # Bridge's setup() with the plan's tokenizer, then provide()'s padding: the embedding's rows
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    vocab, pad = bridge.vocab(model.vocab_size, spec.vocab)
    rows = (
        calculate_padded_vocab_size(vocab, model.make_vocab_size_divisible_by, plan["tp"]) if pad else vocab
    )
    assert rows == plan.padded_vocab
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (
        plan["microbatch_size"],
        plan["global_batch_size"],
    )
    if plan.data["optimizer_sharding"] == "fsdp":
        assert cfg.ddp.use_megatron_fsdp and cfg.checkpoint.ckpt_format == "fsdp_dtensor"
    else:
        assert cfg.ddp.use_distributed_optimizer and not cfg.ddp.use_megatron_fsdp


def _mlm_namespace(flags: list[str]) -> argparse.Namespace:
    """Megatron-LM's arguments for ``flags`` (module docstring: what is built here)."""
    import torch
    from megatron.core.transformer import MLATransformerConfig

    fields = dataclasses.fields(MLATransformerConfig)
    values = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    renamed = {}
    for f in fields:
        for flag in f.metadata.get("argparse_meta", {}).get("arg_names", ()):
            renamed[flag.removeprefix("--").replace("-", "_")] = f.name
    values |= {  # Megatron-LM's parser defaults for the flags the export leaves out
        "no_persist_layer_norm": False,
        "apply_layernorm_1p": False,
        "norm_epsilon": 1e-5,
        "overlap_p2p_comm": True,
        "num_experts": None,
        "rotary_interleaved": False,
        "decoder_first_pipeline_num_layers": None,
        "decoder_last_pipeline_num_layers": None,
        "fp8_param_gather": False,
        "swiglu": False,
        "squared_relu": False,
        "bias_swiglu_fusion": True,
        "bias_gelu_fusion": True,
        "init_method_xavier_uniform": False,
        "group_query_attention": False,
        "config_logger_dir": "",
        "cp_comm_type": ["p2p"],
        "is_hybrid_model": False,
        "multi_latent_attention": False,
        "heterogeneous_layers_config_path": None,
    }
    for key, value in megatron_flags(flags).items():
        if key == "bias_linear":  # --disable-bias-linear: store_false into add_bias_linear
            key = "add_bias_linear"
        values[renamed.get(key, key)] = value
    # validate_args: the dtype from --bf16/--fp16, the virtual size from the chunking flags
    values["params_dtype"] = torch.bfloat16 if values.get("bf16") else torch.float32
    if "moe_layer_freq" in values and isinstance(values["moe_layer_freq"], str):
        values["moe_layer_freq"] = eval(values["moe_layer_freq"])  # Megatron-LM's moe_freq_type
    per_stage = values.pop("num_layers_per_virtual_pipeline_stage", None)
    if per_stage:
        pp = values["pipeline_model_parallel_size"]
        values["virtual_pipeline_model_parallel_size"] = values["num_layers"] // pp // per_stage
    return argparse.Namespace(**values)


@pytest.mark.parametrize("name", PLANS)
def test_megatron_flags_through_bridges_translation(name: str, bridge) -> None:
    """Bridge's copy of Megatron-LM's ``core_transformer_config_from_args`` builds the plan's model
    from the Megatron-LM export."""
    plan = Plan(PLANS[name])
    config = bridge.from_args(_mlm_namespace(megatron_args(plan)))
    _assert_plans_model(config, plan)


def test_bridge_refuses_a_v_shaped_plan(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError, match="places chunks in a V, which Megatron-Bridge cannot run"):
        bridge_text(Plan(ZBV))
    save(ZBV, tmp_path / "zbv.json")
    assert main(["export-plan", str(tmp_path / "zbv.json"), "--to", "bridge"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "zbv places chunks in a V, which Megatron-Bridge cannot run" in err
