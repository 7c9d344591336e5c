"""A plan as the arguments of another trainer: Megatron-LM's command-line flags and torchtitan's TOML.

Both describe the same model chunks as the plan's ``layout`` (models/layout.py: ``E`` the embedding,
``t`` a transformer layer, ``L`` the output layer and loss, ``|`` between chunks, chunk c of the
whole model in order):

- **Megatron-LM** (``megatron/training/arguments.py``; the flags named like
  ``megatron.core.TransformerConfig``'s fields): ``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size``, ``--context-parallel-size``, the batch sizes, recomputation, the
  distributed optimizer, ``--tp-comm-overlap`` where the plan overlaps tensor-parallel communication (a
  plan priced with another framework's overlap, ``async-tp``, gets a note). Equal chunks with the
  embedding and the loss on the first and last chunk: ``--num-layers-per-virtual-pipeline-stage`` (v > 1)
  or nothing (v = 1); any other split (uneven chunks, embedding-only or loss-only chunks):
  ``--pipeline-model-parallel-layout`` with the plan's layout string, which is Megatron-Core's layout
  language (``PipelineParallelLayerLayout``; chunk c runs on pipeline rank c mod p). Megatron-LM runs 1F1B
  (v = 1) or interleaved 1F1B (v > 1): a plan for another schedule is exported with a note saying so; a
  V-shaped placement (zbv, dualpipev, v-half, v-min) has no Megatron-LM form and is refused.
- **torchtitan** (``torchtitan/config/job_config.py``, read with ``--job.config_file``):
  ``[parallelism]`` degrees (``enable_async_tensor_parallel`` where the plan overlaps tensor-parallel
  communication), ``pipeline_parallel_schedule`` (PyTorch's schedule class name, or the
  plan's order as a schedule CSV), ``pipeline_parallel_microbatch_size``; equal chunks as
  ``pipeline_parallel_layers_per_stage`` with ``pipeline_parallel_first/last_stage_less_layers = 0``,
  other splits as ``module_fqns_per_model_part`` (``tok_embeddings``, ``layers.i``, ``norm`` and
  ``output``); ``[training]`` batch sizes; ``[activation_checkpoint]``.

Pure Python: the plan file and the schedule registry only.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.plan.options import RECOMPUTE_ORDER
from pipewright.plan.planfile import Plan

#: The trainers a plan exports to.
TARGETS = ("megatron", "torchtitan")
#: pipewright schedule → PyTorch's schedule class (``torch.distributed.pipelining.get_schedule_class``).
TORCH_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "1f1b-overlap": "1F1B",  # the same order; torchtitan runs the pairs one after the other
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "zbv": "ZBVZeroBubble",
    "zbv-torch": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: Schedules whose chunks sit in a V (rank r holds chunks r and 2p − 1 − r), not round robin.
V_SHAPED = ("zbv", "zbv-torch", "dualpipev", "v-half", "v-min")
#: Megatron-LM's schedule for v = 1 and v > 1.
_MEGATRON_SCHEDULE = {1: "1f1b"}
_DTYPE_FLAG = {"bf16": "--bf16", "fp16": "--fp16"}


@dataclass(frozen=True)
class Chunk:
    """One model chunk of the plan: whether it holds the embedding and the output layer, and its
    transformer layers (global indices)."""

    embedding: bool
    layers: tuple[int, ...]
    output: bool


def chunks(plan: Plan) -> tuple[Chunk, ...]:
    """The plan's model chunks in model order, from its layout string."""
    from pipewright.models.layout import parse_layout

    out, first = [], 0
    for stage in parse_layout(plan.layout).stages:
        n = len(stage.layers)
        out.append(Chunk(stage.embedding, tuple(range(first, first + n)), stage.head))
        first += n
    return tuple(out)


def is_uniform(parts: Sequence[Chunk]) -> bool:
    """Equal layer counts, the embedding on the first chunk and the output layer on the last only."""
    counts = {len(c.layers) for c in parts}
    ends = parts[0].embedding and parts[-1].output
    inner = not any(c.embedding for c in parts[1:]) and not any(c.output for c in parts[:-1])
    return len(counts) == 1 and counts != {0} and ends and inner


def _recompute(plan: Plan) -> tuple[str, bool]:
    """The run's recomputation (the strongest any stage uses) and whether the stages differ."""
    per_stage = plan.data.get("recompute_per_stage") or [plan.data.get("recompute", "none")]
    strongest = max(per_stage, key=RECOMPUTE_ORDER.index)
    return strongest, len(set(per_stage)) > 1


def _layers(plan: Plan) -> int:
    return int(plan["model"]["layers"])


def _check_schedule(plan: Plan, target: str) -> None:
    if target == "megatron" and plan["schedule"] in V_SHAPED:
        raise ConfigError(
            f"the plan's schedule {plan['schedule']} places chunks in a V, which Megatron-LM cannot run "
            "(chunk c on pipeline rank c mod p); export it --to torchtitan, or plan with --schedules "
            "1f1b,interleaved-1f1b,zb-h1"
        )


def megatron_args(plan: Plan) -> list[str]:
    """Megatron-LM's flags for ``plan`` (``pretrain_gpt.py``): model shape, parallel degrees, chunks,
    batch sizes, precision, recomputation and optimizer sharding."""
    _check_schedule(plan, "megatron")
    model, parts = plan["model"], chunks(plan)
    pp, v = int(plan["pp"]), int(plan.data.get("virtual", 1))
    args = [
        *("--num-layers", str(model["layers"])),
        *("--hidden-size", str(model["hidden"])),
        *("--ffn-hidden-size", str(model["ffn_hidden"])),
        *("--num-attention-heads", str(model["heads"])),
        *("--seq-length", str(model["seq_len"])),
        *("--max-position-embeddings", str(model["seq_len"])),
    ]
    kv = model.get("kv_heads")
    if kv and kv != model["heads"]:
        args += ["--group-query-attention", "--num-query-groups", str(kv)]
    if model.get("mlp") == "swiglu":
        args.append("--swiglu")
    if model.get("bias") is False:
        args.append("--disable-bias-linear")
    args += [
        *("--tensor-model-parallel-size", str(plan["tp"])),
        *("--pipeline-model-parallel-size", str(pp)),
        *("--context-parallel-size", str(plan.data.get("cp", 1))),
    ]
    if not is_uniform(parts):
        args += ["--pipeline-model-parallel-layout", plan.layout]
    elif v > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(len(parts[0].layers))]
    if plan.microbatch_group is not None:  # Megatron-Core's microbatch_group_size_per_vp_stage
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(plan.microbatch_group)]
    if plan.data.get("sequence_parallel") and int(plan["tp"]) > 1:
        args.append("--sequence-parallel")
    # Megatron-Core's own overlap (a note where the plan's differs); Megatron-LM asserts it runs with
    # sequence parallelism, which it turns off at tp 1
    if plan.tp_comm_overlap != "none" and int(plan["tp"]) > 1 and plan.data.get("sequence_parallel"):
        args.append("--tp-comm-overlap")
    args += [
        *("--micro-batch-size", str(plan["microbatch_size"])),
        *("--global-batch-size", str(plan["global_batch_size"])),
    ]
    dtype = plan.data.get("dtype", "bf16")
    if dtype in _DTYPE_FLAG:
        args.append(_DTYPE_FLAG[dtype])
    elif dtype == "fp8":
        args += ["--bf16", "--fp8-format", "hybrid"]
    recompute, _ = _recompute(plan)
    if recompute in ("selective", "op"):  # op: Megatron-LM's nearest (a note says so)
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        method = plan.data.get("recompute_method") or "uniform"
        count = str(plan.data.get("recompute_num_layers") or 1)
        args += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            method,
            "--recompute-num-layers",
            count,
        ]
    sharding = plan.data.get("optimizer_sharding", "none")
    if sharding == "zero1":
        args.append("--use-distributed-optimizer")
    elif sharding == "fsdp":
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    if plan.data.get("grad_reduce", "overlap") == "overlap" and int(plan["dp"]) > 1:
        args.append("--overlap-grad-reduce")
    return args


def notes(plan: Plan, target: str) -> list[str]:
    """What the target runs differently from the plan (schedule, tensor-parallel overlap, per-stage
    recomputation)."""
    out = []
    name, v = plan["schedule"], int(plan.data.get("virtual", 1))
    if target == "megatron":
        runs = _MEGATRON_SCHEDULE.get(v, "interleaved-1f1b")
        if name != runs:
            out.append(
                f"the plan's schedule is {name}; Megatron-LM runs {runs} with these chunks, so its "
                "iteration differs from the plan's prediction"
            )
    else:
        if name not in TORCH_SCHEDULES:
            out.append(
                f"the plan's schedule {name} has no PyTorch class: its order is given as a schedule CSV"
            )
        if plan.data.get("optimizer_sharding") == "zero1" and int(plan["dp"]) > 1:
            out.append(
                "torchtitan shards weights, gradients and optimizer state over data parallelism (FSDP); "
                "the plan shards only the optimizer state (ZeRO-1)"
            )
    overlap = _target_tp_overlap(target)
    if plan.tp_comm_overlap not in ("none", overlap):
        out.append(
            f"the plan prices --tp-comm-overlap {plan.tp_comm_overlap}; {target} overlaps tensor-parallel "
            f"communication its own way ({overlap}), so its iteration differs from the plan's prediction"
        )
    recompute, mixed = _recompute(plan)
    if recompute == "op" and target == "megatron":
        out.append(
            "the plan recomputes with torchtitan's operator-level policy (op); Megatron-LM has no such "
            "policy and runs selective recomputation (the attention core) instead"
        )
    method = plan.data.get("recompute_method")
    if method and recompute == "full" and target != "megatron":
        out.append(
            f"the plan recomputes with Megatron-LM's --recompute-method {method} "
            f"--recompute-num-layers {plan.data.get('recompute_num_layers') or 1}; torchtitan's full "
            "activation checkpointing wraps every block"
        )
    if mixed:
        per = ",".join(plan.data["recompute_per_stage"])
        out.append(f"recomputation differs per stage ({per}); both trainers take one setting: {recompute}")
    return out


def _target_tp_overlap(target: str) -> str | None:
    """The ``--tp-comm-overlap`` mode ``target`` runs: the framework of that name's
    (:attr:`pipewright.cost.frameworks.Framework.tp_overlap`)."""
    from pipewright.cost.frameworks import framework

    return framework(target).tp_overlap


def megatron_text(plan: Plan, source: str = "plan") -> str:
    """A shell fragment: comment lines (the plan, the notes) and ``MEGATRON_ARGS=(…)``."""
    args = megatron_args(plan)
    lines = [f"# Megatron-LM arguments of {source}: {_summary(plan)}"]
    lines += [f"# note: {n}" for n in notes(plan, "megatron")]
    lines.append("MEGATRON_ARGS=(")
    i = 0
    while i < len(args):
        pair = i + 1 < len(args) and not args[i + 1].startswith("--")
        lines.append("  " + " ".join(shlex.quote(a) for a in args[i : i + (2 if pair else 1)]))
        i += 2 if pair else 1
    lines.append(")")
    return "\n".join(lines) + "\n"


def torchtitan_config(plan: Plan, schedule_csv: str | None = None) -> dict[str, dict[str, object]]:
    """torchtitan's job config tables for ``plan``; ``schedule_csv``: the path of the plan's order as
    a PyTorch schedule CSV, for a schedule PyTorch has no class for."""
    _check_schedule(plan, "torchtitan")
    parts = chunks(plan)
    dp, cp, v = int(plan["dp"]), int(plan.data.get("cp", 1)), int(plan.data.get("virtual", 1))
    fsdp = plan.data.get("optimizer_sharding", "none") != "none"
    async_tp = plan.tp_comm_overlap != "none" and int(plan["tp"]) > 1
    para: dict[str, object] = {
        "data_parallel_replicate_degree": 1 if fsdp else dp,
        "data_parallel_shard_degree": dp if fsdp else 1,
        "tensor_parallel_degree": int(plan["tp"]),
        "enable_async_tensor_parallel": async_tp,
        "context_parallel_degree": cp,
        "pipeline_parallel_degree": int(plan["pp"]),
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
        para["module_fqns_per_model_part"] = [_fqns(c) for c in parts]
    local = int(plan["global_batch_size"]) // dp
    training = {
        "local_batch_size": local,
        "global_batch_size": int(plan["global_batch_size"]),
        "seq_len": int(plan["model"]["seq_len"]),
        "mixed_precision_param": "bfloat16"
        if plan.data.get("dtype", "bf16") in ("bf16", "fp8")
        else "float32",
    }
    recompute, _ = _recompute(plan)
    checkpoint: dict[str, object] = {"mode": "selective" if recompute == "op" else recompute}
    if recompute in ("selective", "op"):
        checkpoint["selective_ac_option"] = "op"
    tables = {"parallelism": para, "training": training, "activation_checkpoint": checkpoint}
    if async_tp:  # torchtitan runs async TP only on compiled blocks ("Async TP requires torch.compile")
        tables["compile"] = {"enable": True, "components": ["model"]}
    return tables


def _fqns(chunk: Chunk) -> list[str]:
    """torchtitan's module names of a chunk (its Llama/GPT-style models' names)."""
    names = ["tok_embeddings"] if chunk.embedding else []
    names += [f"layers.{i}" for i in chunk.layers]
    return names + (["norm", "output"] if chunk.output else [])


def torchtitan_text(plan: Plan, source: str = "plan", schedule_csv: str | None = None) -> str:
    """The TOML torchtitan reads (``--job.config_file``): comments, then the three tables."""
    tables = torchtitan_config(plan, schedule_csv)
    lines = [f"# torchtitan job config of {source}: {_summary(plan)}"]
    lines += [f"# note: {n}" for n in notes(plan, "torchtitan")]
    for table, values in tables.items():
        lines += ["", f"[{table}]"] + [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    """A TOML value: bool, int, string, or list of them (JSON's spelling is TOML's for these)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def _summary(plan: Plan) -> str:
    return (
        f"{plan['model'].get('name', 'model')}, tp {plan['tp']} cp {plan.data.get('cp', 1)} pp {plan['pp']} "
        f"dp {plan['dp']} v {plan.data.get('virtual', 1)}, {plan['schedule']}, layout {plan.layout}"
    )


def export_text(plan: Plan, target: str, source: str = "plan", schedule_csv: str | None = None) -> str:
    """The plan for ``target`` (:data:`TARGETS`)."""
    if target == "megatron":
        return megatron_text(plan, source)
    if target == "torchtitan":
        return torchtitan_text(plan, source, schedule_csv)
    raise ConfigError(f"--to {target!r}: choose one of {', '.join(TARGETS)}")
