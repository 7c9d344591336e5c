"""A plan as torchtitan's job config: the TOML torchtitan 0.2.2 reads (``--job.config_file``;
``torchtitan/config/job_config.py``), the last release that reads TOML; torchtitan 0.3.0 takes Python
config classes chosen and overridden on its command line: ``--to torchtitan-0.3``
(plan/export_torchtitan_args.py).

- ``[model]``: ``name`` (torchtitan's train spec: ``llama3`` for the Llama family, ``deepseek_v3`` for a
  mixture of experts with latent attention) and ``flavor``, the flavor whose dimensions are the plan's
  (:data:`FLAVORS`, checked against torchtitan's own tables in the tests). A model no flavor matches
  gets the plan's model name as its flavor and a note: torchtitan refuses an unknown flavor, where a
  missing ``[model]`` would silently build its 6-layer debug model.
- ``[parallelism]``: degrees, ``expert_parallel_degree``, ``enable_async_tensor_parallel`` where the
  plan overlaps tensor-parallel communication, ``pipeline_parallel_schedule`` (PyTorch's schedule class
  name, or the plan's order as a schedule CSV), ``pipeline_parallel_microbatch_size``; equal chunks as
  ``pipeline_parallel_layers_per_stage`` with ``pipeline_parallel_first/last_stage_less_layers = 0``,
  other splits as ``module_fqns_per_model_part`` (``tok_embeddings``, ``layers.i``, ``norm`` and
  ``output``).
- ``[training]`` batch sizes and sequence, ``[activation_checkpoint]``.
"""

from __future__ import annotations

import json

from pipewright.errors import ConfigError
from pipewright.plan.export import (
    TORCH_SCHEDULES,
    Chunk,
    chunks,
    is_uniform,
    notes,
    recompute_setting,
    summary,
)
from pipewright.plan.export_model import Architecture, architecture
from pipewright.plan.planfile import Plan

#: torchtitan 0.2.2's flavors: (family, layers, hidden, heads, kv heads, vocabulary, experts, top-k) →
#: (train spec, flavor) (``torchtitan.models.llama3.llama3_args``, ``deepseek_v3.deepseekv3_args``).
FLAVORS = {
    ("llama", 32, 4096, 32, 8, 128256, 0, 2): ("llama3", "8B"),
    ("llama", 80, 8192, 64, 8, 128256, 0, 2): ("llama3", "70B"),
    ("llama", 126, 16384, 128, 8, 128256, 0, 2): ("llama3", "405B"),
    ("llama", 61, 7168, 128, 128, 129280, 256, 8): ("deepseek_v3", "671B"),
}
RELEASE = "0.2.2"


def _key(arch: Architecture) -> tuple:
    s = arch.spec
    experts = (s.moe_experts, s.moe_top_k) if s.is_moe else (0, 2)
    return (s.family, s.layers, s.hidden, s.heads, s.kv_heads, s.vocab, *experts)


def model_table(arch: Architecture) -> tuple[dict[str, object], list[str]]:
    """torchtitan's ``[model]`` for the plan's model, and the notes when no flavor matches."""
    found = FLAVORS.get(_key(arch))
    if found is not None:
        return {"name": found[0], "flavor": found[1]}, []
    spec = arch.spec
    name = (
        "deepseek_v3" if spec.attention_kind == "mla" else "llama3" if spec.family == "llama" else spec.family
    )
    why = (
        f"torchtitan {RELEASE} has no {name} flavor with layers {spec.layers}, hidden {spec.hidden}, heads "
        f"{spec.heads}, kv heads {spec.kv_heads}, vocabulary {spec.vocab}"
        + (f", {spec.moe_experts} experts top-{spec.moe_top_k}" if spec.is_moe else "")
        + f": register flavor {spec.name!r} under train spec {name!r} (torchtitan refuses it until then)"
    )
    if spec.family != "llama":
        why = (
            f"torchtitan {RELEASE} has no {spec.family} model ({arch.normalization}, "
            f"{arch.position_embedding} positions): register train spec {name!r} with flavor "
            f"{spec.name!r} (torchtitan refuses it until then)"
        )
    return {"name": name, "flavor": spec.name}, [why]


def torchtitan_config(plan: Plan, schedule_csv: str | None = None) -> dict[str, dict[str, object]]:
    """torchtitan's job config tables for ``plan``; ``schedule_csv``: the path of the plan's order as
    a PyTorch schedule CSV, for a schedule PyTorch has no class for."""
    parts = chunks(plan)
    dp, cp, v = int(plan["dp"]), int(plan.data.get("cp", 1)), int(plan.data.get("virtual", 1))
    fsdp = plan.data.get("optimizer_sharding", "none") != "none"
    async_tp = plan.tp_comm_overlap != "none" and int(plan["tp"]) > 1
    model, _ = model_table(architecture(plan["model"]))
    para: dict[str, object] = {
        "data_parallel_replicate_degree": 1 if fsdp else dp,
        "data_parallel_shard_degree": dp if fsdp else 1,
        "tensor_parallel_degree": int(plan["tp"]),
        "enable_async_tensor_parallel": async_tp,
        "context_parallel_degree": cp,
        "pipeline_parallel_degree": int(plan["pp"]),
        "expert_parallel_degree": int(plan.data.get("ep", 1)),
        "pipeline_parallel_microbatch_size": int(plan["microbatch_size"]),
    }
    name = plan["schedule"]
    if name in TORCH_SCHEDULES:
        para["pipeline_parallel_schedule"] = TORCH_SCHEDULES[name]
    else:
        para["pipeline_parallel_schedule"] = "PipelineScheduleSingle" if v == 1 else "PipelineScheduleMulti"
        para["pipeline_parallel_schedule_csv"] = schedule_csv or f"{name}.schedule.csv"
    if is_uniform(parts):
        para["pipeline_parallel_layers_per_stage"] = len(parts[0].layers)
        para["pipeline_parallel_first_stage_less_layers"] = 0
        para["pipeline_parallel_last_stage_less_layers"] = 0
    else:
        para["module_fqns_per_model_part"] = [fqns(c) for c in parts]
    training = {
        "local_batch_size": int(plan["global_batch_size"]) // dp,
        "global_batch_size": int(plan["global_batch_size"]),
        "seq_len": int(plan["model"]["seq_len"]),
        "mixed_precision_param": "bfloat16"
        if plan.data.get("dtype", "bf16") in ("bf16", "fp8")
        else "float32",
    }
    recompute, _ = recompute_setting(plan)
    checkpoint: dict[str, object] = {"mode": "selective" if recompute == "op" else recompute}
    if recompute in ("selective", "op"):
        checkpoint["selective_ac_option"] = "op"
    tables = {"model": model, "parallelism": para, "training": training, "activation_checkpoint": checkpoint}
    if async_tp:  # torchtitan runs async TP only on compiled blocks ("Async TP requires torch.compile")
        tables["compile"] = {"enable": True, "components": ["model"]}
    return tables


def torchtitan_notes(plan: Plan) -> list[str]:
    """What torchtitan's TOML does not carry from the plan."""
    arch = architecture(plan["model"])
    _, out = model_table(arch)
    out = [*arch.assumed, *out]
    spec = arch.spec
    if plan.microbatch_group is not None:
        out.append(
            f"the plan groups {plan.microbatch_group} microbatches per virtual stage (interleaved 1F1B); "
            "torchtitan's Interleaved1F1B has no such setting and groups p"
        )
    if spec.is_moe and (spec.moe_capacity or spec.moe_aux_loss_coeff):
        out.append(
            "the flavor sets the router (load-balancing, capacity); the plan prices capacity factor "
            f"{spec.moe_capacity or 'none (dropless)'} and auxiliary loss coefficient "
            f"{spec.moe_aux_loss_coeff}"
        )
    if arch.padded_vocab != spec.vocab:
        out.append(
            f"the plan prices a padded vocabulary of {arch.padded_vocab}; torchtitan does not pad "
            f"{spec.vocab}"
        )
    out.append(
        f"written for torchtitan {RELEASE} (TOML job config); torchtitan 0.3.0 reads no TOML: export "
        "--to torchtitan-0.3 for it"
    )
    return out + notes(plan, "torchtitan")


def fqns(chunk: Chunk) -> list[str]:
    """torchtitan's module names of a chunk (its Llama/DeepSeek-style models' names)."""
    names = ["tok_embeddings"] if chunk.embedding else []
    names += [f"layers.{i}" for i in chunk.layers]
    return names + (["norm", "output"] if chunk.output else [])


def torchtitan_text(plan: Plan, source: str = "plan", schedule_csv: str | None = None) -> str:
    """The TOML torchtitan reads (``--job.config_file``): comments, then the tables."""
    tables = torchtitan_config(plan, schedule_csv)
    lines = [f"# torchtitan {RELEASE} job config of {source}: {summary(plan)}"]
    lines += [f"# note: {n}" for n in torchtitan_notes(plan)]
    for table, values in tables.items():
        lines += ["", f"[{table}]"] + [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    """A TOML value: bool, int, string, or list of them (JSON's spelling is TOML's for these)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, int | str | list):
        raise ConfigError(f"no TOML form for {value!r}")
    return json.dumps(value)
