"""A plan as a Megatron-Bridge recipe override: a Python module for ``megatron-bridge`` 0.3.1
(``megatron.bridge.training.config.ConfigContainer``; Bridge's recipes are Python functions returning
one, and its documentation overrides them in Python, YAML or ``key=value`` lists).

The module defines ``model_provider()``, the whole model the plan priced as Bridge's
``GPTModelProvider`` (``MLAModelProvider`` for latent attention) — Megatron-Core's
``TransformerConfig`` fields, so the names are Megatron-LM's flags' dataclass fields
(plan/export_megatron.py) — with the plan's degrees and layout on it, and ``apply_plan(cfg)``, which puts
that model, the batch sizes, precision, optimizer sharding and tensor-parallel overlap on a recipe's
``ConfigContainer`` (its data, optimizer and logging stay the recipe's). Python, not YAML: Bridge's YAML
overrides (``omegaconf_utils.apply_overrides``) keep the recipe's provider class and leave out callables,
so they cannot set latent attention or the activation function, which the whole model needs.

Bridge derives data parallelism from the world size (``ConfigContainer.get_data_parallel_size``), as
Megatron-LM does; chunk c sits on pipeline rank c mod p, so a V-shaped placement is refused.
"""

from __future__ import annotations

from pipewright.plan.export import chunks, is_uniform, notes, recompute_setting, summary
from pipewright.plan.export_megatron import (
    check_schedule,
    core_notes,
    megatron_layout,
    world_note,
)
from pipewright.plan.export_model import Architecture, architecture
from pipewright.plan.planfile import Plan

RELEASE = "0.3.1"
#: pipewright dtype → Bridge's mixed-precision recipe name (``training/mixed_precision.py``).
_PRECISION = {
    "bf16": "bf16_mixed",
    "fp16": "fp16_mixed",
    "fp32": None,
    "fp8": "bf16_with_fp8_delayed_scaling_mixed",
}


class Code(str):
    """A Python expression written as is (a function, a dtype), not as a literal."""


#: The activation of each MLP (``F`` is ``torch.nn.functional``; Megatron-Core's ``squared_relu``).
_ACTIVATION = {"swiglu": Code("F.silu"), "relu2": Code("squared_relu"), "gelu": Code("F.gelu")}


def model_fields(arch: Architecture, ep: int = 1) -> dict[str, object]:
    """The provider's architecture fields (Megatron-Core ``TransformerConfig`` / Bridge
    ``GPTModelProvider`` names) for the plan's model."""
    spec = arch.spec
    out: dict[str, object] = {
        "num_layers": spec.layers,
        "hidden_size": spec.hidden,
        "ffn_hidden_size": spec.ffn_hidden,
        "num_attention_heads": spec.heads,
        "num_query_groups": spec.kv_heads,
        "seq_length": spec.seq_len,
        # Bridge's setup keeps a vocab_size given here unpadded (_validate_and_set_vocab_size): the
        # padded size the plan priced
        "vocab_size": arch.padded_vocab,
        "normalization": arch.normalization,
        "position_embedding_type": arch.position_embedding,
        "share_embeddings_and_output_weights": spec.tied_embeddings,
        "activation_func": _ACTIVATION[spec.mlp],
        "gated_linear_unit": spec.mlp == "swiglu",
        "add_bias_linear": spec.bias,
    }
    if arch.position_embedding == "rope":
        out["rotary_base"] = int(spec.rope_theta)
    if spec.attention_kind == "mla":
        from pipewright.cost.mla import DEEPSEEK_V3_MLA as mla

        out |= {"multi_latent_attention": True, "q_lora_rank": mla.q_rank, "kv_lora_rank": mla.kv_rank}
        out |= {"qk_head_dim": mla.nope_dim, "qk_pos_emb_head_dim": mla.rope_dim, "v_head_dim": mla.v_dim}
    if spec.mtp_depth:
        out["mtp_num_layers"] = spec.mtp_depth
    if spec.is_moe:
        out |= {
            "num_moe_experts": spec.moe_experts,
            "moe_router_topk": spec.moe_top_k,
            "moe_ffn_hidden_size": spec.expert_ffn,
            "expert_model_parallel_size": ep,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(spec.moe_aux_loss_coeff),
        }
        if spec.moe_shared_experts:
            out["moe_shared_expert_intermediate_size"] = spec.moe_shared_experts * spec.expert_ffn
        if spec.moe_dense_layers:
            out["moe_layer_freq"] = [int(spec.is_moe_layer(i)) for i in range(spec.layers)]
        if spec.moe_z_loss_coeff:
            out["moe_z_loss_coeff"] = float(spec.moe_z_loss_coeff)
        if spec.moe_capacity:
            out["moe_expert_capacity_factor"] = float(spec.moe_capacity)
        if spec.moe_capacity or ep > 1:
            out["moe_token_dispatcher_type"] = "alltoall"
    return out


def layout_fields(plan: Plan) -> dict[str, object]:
    """Degrees, chunks (equal: the virtual size; else Megatron-Core's layout string) and
    recomputation, as provider fields."""
    parts, pp = chunks(plan), int(plan["pp"])
    v, tp = int(plan.data.get("virtual", 1)), int(plan["tp"])
    out: dict[str, object] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": int(plan.data.get("cp", 1)),
        "sequence_parallel": bool(plan.data.get("sequence_parallel")) and tp > 1,
        "pipeline_dtype": Code("torch.float16" if plan.data.get("dtype") == "fp16" else "torch.bfloat16"),
    }
    if not is_uniform(parts):
        spec = architecture(plan["model"]).spec
        out["pipeline_model_parallel_layout"] = megatron_layout(plan.layout, spec.mtp_depth)
    elif v > 1:
        out["virtual_pipeline_model_parallel_size"] = v
    if plan.microbatch_group is not None:
        out["microbatch_group_size_per_vp_stage"] = plan.microbatch_group
    recompute, _ = recompute_setting(plan)
    if recompute in ("selective", "op"):
        out["recompute_granularity"] = "selective"
    elif recompute == "full":
        out["recompute_granularity"] = "full"
        out["recompute_method"] = plan.data.get("recompute_method") or "uniform"
        out["recompute_num_layers"] = int(plan.data.get("recompute_num_layers") or 1)
    return out


def container_settings(plan: Plan) -> list[tuple[str, object]]:
    """``cfg.<section>.<field> = value`` for the container (after ``cfg.model``)."""
    seq = int(plan["model"]["seq_len"])
    sharding = plan.data.get("optimizer_sharding", "none")
    overlap = plan.data.get("grad_reduce", "overlap") == "overlap" and int(plan["dp"]) > 1
    tp_overlap = plan.tp_comm_overlap != "none" and int(plan["tp"]) > 1 and plan.data.get("sequence_parallel")
    out: list[tuple[str, object]] = [
        ("train.micro_batch_size", int(plan["microbatch_size"])),
        ("train.global_batch_size", int(plan["global_batch_size"])),
        ("dataset.seq_length", seq),
        ("mixed_precision", _PRECISION.get(plan.data.get("dtype", "bf16"))),
        ("comm_overlap", Code("CommOverlapConfig(tp_comm_overlap=True)") if tp_overlap else None),
        ("ddp.overlap_grad_reduce", overlap),
        ("ddp.use_distributed_optimizer", sharding != "none"),
        ("optimizer.use_distributed_optimizer", sharding != "none"),
        ("ddp.use_megatron_fsdp", sharding == "fsdp"),
        ("dist.use_megatron_fsdp", sharding == "fsdp"),
    ]
    if sharding == "fsdp":  # Bridge's check: Megatron-FSDP saves and loads fsdp_dtensor checkpoints
        out += [("ddp.data_parallel_sharding_strategy", "optim_grads_params")]
        out += [("checkpoint.ckpt_format", "fsdp_dtensor")]
    else:
        out += [("ddp.data_parallel_sharding_strategy", "no_shard")]
    return out


def bridge_notes(plan: Plan) -> list[str]:
    """What the module does not carry from the plan (as for Megatron-LM: schedule, overlap,
    per-stage recomputation, device order)."""
    vocab, padded = plan["model"]["vocab"], plan.padded_vocab
    out = core_notes(plan, "Megatron-Bridge", "rotary_base", pads=False)
    out.append(
        f"vocab_size is the plan's padded vocabulary {padded}, which Bridge keeps as given; the tokenizer's "
        f"is {vocab} (NullTokenizer: cfg.tokenizer.vocab_size = {vocab}) and may not exceed it"
    )
    out.append(world_note(plan))
    return out + [n.replace("Megatron-LM", "Megatron-Bridge") for n in notes(plan, "megatron")]


def _value(value: object) -> str:
    return str(value) if isinstance(value, Code) else repr(value)


def bridge_text(plan: Plan, source: str = "plan") -> str:
    """The Python module (comments, ``model_provider``, ``apply_plan``)."""
    check_schedule(plan, "Megatron-Bridge")
    arch = architecture(plan["model"])
    fields = model_fields(arch, int(plan.data.get("ep", 1))) | layout_fields(plan)
    provider = "MLAModelProvider" if arch.spec.attention_kind == "mla" else "GPTModelProvider"
    module = "mla_provider" if provider == "MLAModelProvider" else "gpt_provider"
    lines = [f"# Megatron-Bridge {RELEASE} recipe override of {source}: {summary(plan)}"]
    lines += [f"# note: {n}" for n in bridge_notes(plan)]
    settings = container_settings(plan)
    lines += [
        '"""Use on any pretraining recipe: ``cfg = apply_plan(gpt3_175b_pretrain_config())``."""',
        "",
        "import torch",
        "import torch.nn.functional as F",
    ]
    if fields["activation_func"] == _ACTIVATION["relu2"]:
        lines.append("from megatron.core.activations import squared_relu")
    lines.append(f"from megatron.bridge.models.{module} import {provider}")
    if any(isinstance(v, Code) and "CommOverlapConfig" in v for _, v in settings):
        lines.append("from megatron.bridge.training.comm_overlap import CommOverlapConfig")
    lines += [
        "from megatron.bridge.training.config import ConfigContainer",
        "",
        "",
        f"def model_provider() -> {provider}:",
        f"    return {provider}(",
        *(f"        {k}={_value(v)}," for k, v in fields.items()),
        "    )",
        "",
        "",
        "def apply_plan(cfg: ConfigContainer) -> ConfigContainer:",
        "    cfg.model = model_provider()",
        *(f"    cfg.{k} = {_value(v)}" for k, v in settings),
        "    return cfg",
    ]
    return "\n".join(lines) + "\n"
