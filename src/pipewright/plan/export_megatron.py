"""A plan as Megatron-LM's command-line arguments (``pretrain_gpt.py``; ``megatron/training/arguments.py``
of Megatron-LM core_r0.16, whose flags are named like ``megatron.core.TransformerConfig``'s fields).

The whole model the plan priced (plan/export_model.py), so that Megatron-LM builds that model and not
its defaults (LayerNorm, learned positions, tied embeddings, rotary base 10000, dense):

- dimensions: ``--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --seq-length
  --max-position-embeddings``, ``--group-query-attention --num-query-groups`` (kv heads < heads),
  ``--vocab-size`` with ``--make-vocab-size-divisible-by 128`` (Megatron pads to 128·tp, as the plan);
- ``--normalization RMSNorm|LayerNorm``, ``--position-embedding-type rope|learned_absolute`` and
  ``--rotary-base``, ``--untie-embeddings-and-output-weights`` (an untied output layer), ``--swiglu`` /
  ``--squared-relu`` (gelu is the default), ``--disable-bias-linear``;
- mixture of experts: ``--num-experts --moe-router-topk --moe-ffn-hidden-size
  --expert-model-parallel-size``, shared experts as ``--moe-shared-expert-intermediate-size`` (their
  summed width), the dense first layers as ``--moe-layer-freq``, ``--moe-aux-loss-coeff`` /
  ``--moe-z-loss-coeff``, a capacity factor with ``--moe-expert-capacity-factor`` (the all-to-all
  dispatcher, which Megatron-Core requires for capacity and expert parallelism);
- DeepSeek's multi-head latent attention (``--multi-latent-attention`` with the ranks the cost model
  priced, :mod:`pipewright.cost.mla`) and ``--mtp-num-layers``.

The layout: degrees, ``--num-layers-per-virtual-pipeline-stage`` (equal chunks, v > 1) or
``--pipeline-model-parallel-layout`` (any other split; Megatron-Core's layout language, chunk c on
pipeline rank c mod p), microbatches, recomputation, optimizer sharding (the distributed optimizer, or
Megatron-FSDP with the ``fsdp_dtensor`` checkpoint format its argument check requires). Data
parallelism is not a flag: Megatron-LM derives it from the world size (tp·cp·pp·dp processes).
Megatron-LM runs 1F1B (v = 1) or interleaved 1F1B (v > 1); a V-shaped placement is refused.
"""

from __future__ import annotations

import shlex

from pipewright.errors import ConfigError
from pipewright.plan.export import V_SHAPED, chunks, is_uniform, notes, recompute_setting, summary
from pipewright.plan.export_model import Architecture, architecture
from pipewright.plan.planfile import Plan

_DTYPE_FLAG = {"bf16": "--bf16", "fp16": "--fp16"}
_MLP_FLAG = {"swiglu": "--swiglu", "relu2": "--squared-relu", "gelu": None}
#: Megatron-LM pads the vocabulary to a multiple of this times tp (``--make-vocab-size-divisible-by``).
VOCAB_MULTIPLE = 128


def check_schedule(plan: Plan, trainer: str = "Megatron-LM") -> None:
    """One-line error for a V-shaped schedule (chunk c is on rank c mod p in Megatron-Core)."""
    if plan["schedule"] in V_SHAPED:
        raise ConfigError(
            f"the plan's schedule {plan['schedule']} places chunks in a V, which {trainer} cannot run "
            "(chunk c on pipeline rank c mod p); export it --to torchtitan, or plan with --schedules "
            "1f1b,interleaved-1f1b,zb-h1"
        )


def model_args(arch: Architecture, ep: int = 1) -> list[str]:
    """The flags that make Megatron-LM build the plan's model (module docstring)."""
    spec = arch.spec
    args = [
        *("--num-layers", str(spec.layers)),
        *("--hidden-size", str(spec.hidden)),
        *("--ffn-hidden-size", str(spec.ffn_hidden)),
        *("--num-attention-heads", str(spec.heads)),
        *("--seq-length", str(spec.seq_len)),
        *("--max-position-embeddings", str(spec.seq_len)),
        *("--vocab-size", str(spec.vocab)),
        *("--make-vocab-size-divisible-by", str(VOCAB_MULTIPLE)),
        *("--normalization", arch.normalization),
        *("--position-embedding-type", arch.position_embedding),
    ]
    if arch.position_embedding == "rope":
        args += ["--rotary-base", str(int(spec.rope_theta))]
    if not spec.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if spec.kv_heads != spec.heads:
        args += ["--group-query-attention", "--num-query-groups", str(spec.kv_heads)]
    if _MLP_FLAG[spec.mlp]:
        args.append(_MLP_FLAG[spec.mlp])
    if not spec.bias:
        args.append("--disable-bias-linear")
    if spec.attention_kind == "mla":
        from pipewright.cost.mla import DEEPSEEK_V3_MLA as mla

        args += ["--multi-latent-attention", "--q-lora-rank", str(mla.q_rank)]
        args += ["--kv-lora-rank", str(mla.kv_rank), "--qk-head-dim", str(mla.nope_dim)]
        args += ["--qk-pos-emb-head-dim", str(mla.rope_dim), "--v-head-dim", str(mla.v_dim)]
    if spec.mtp_depth:
        args += ["--mtp-num-layers", str(spec.mtp_depth)]
    if spec.is_moe:
        args += moe_args(arch, ep)
    return args


def moe_args(arch: Architecture, ep: int) -> list[str]:
    """Megatron-Core's mixture-of-experts flags for the plan's experts."""
    spec = arch.spec
    args = [
        *("--num-experts", str(spec.moe_experts)),
        *("--moe-router-topk", str(spec.moe_top_k)),
        *("--moe-ffn-hidden-size", str(spec.expert_ffn)),
        *("--expert-model-parallel-size", str(ep)),
        *("--moe-router-load-balancing-type", "aux_loss"),
        *("--moe-aux-loss-coeff", repr(float(spec.moe_aux_loss_coeff))),
    ]
    if spec.moe_shared_experts:
        args += ["--moe-shared-expert-intermediate-size", str(spec.moe_shared_experts * spec.expert_ffn)]
    if spec.moe_dense_layers:
        dense, sparse = spec.moe_dense_layers, spec.layers - spec.moe_dense_layers
        args += ["--moe-layer-freq", f"([0]*{dense}+[1]*{sparse})"]
    if spec.moe_z_loss_coeff:
        args += ["--moe-z-loss-coeff", repr(float(spec.moe_z_loss_coeff))]
    if spec.moe_capacity:
        args += ["--moe-expert-capacity-factor", repr(float(spec.moe_capacity))]
    if spec.moe_capacity or ep > 1:
        args += ["--moe-token-dispatcher-type", "alltoall"]
    return args


def megatron_args(plan: Plan) -> list[str]:
    """Megatron-LM's flags for ``plan``: the model (:func:`model_args`), parallel degrees, chunks, batch
    sizes, precision, recomputation and optimizer sharding."""
    check_schedule(plan)
    parts = chunks(plan)
    pp, v = int(plan["pp"]), int(plan.data.get("virtual", 1))
    ep = int(plan.data.get("ep", 1))
    arch = architecture(plan["model"])
    args = model_args(arch, ep)
    args += [
        *("--tensor-model-parallel-size", str(plan["tp"])),
        *("--pipeline-model-parallel-size", str(pp)),
        *("--context-parallel-size", str(plan.data.get("cp", 1))),
    ]
    if not is_uniform(parts):
        args += ["--pipeline-model-parallel-layout", megatron_layout(plan.layout, arch.spec.mtp_depth)]
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
    args += _recompute_args(plan)
    sharding = plan.data.get("optimizer_sharding", "none")
    if sharding == "zero1":
        args.append("--use-distributed-optimizer")
    elif sharding == "fsdp":  # Megatron-LM's argument check: Megatron-FSDP saves fsdp_dtensor checkpoints
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
        args += ["--ckpt-format", "fsdp_dtensor"]
    if plan.data.get("grad_reduce", "overlap") == "overlap" and int(plan["dp"]) > 1:
        args.append("--overlap-grad-reduce")
    return args


def megatron_layout(layout: str, mtp_depth: int) -> str:
    """The plan's layout in Megatron-Core's language, with the multi-token-prediction modules (``m``)
    where the cost model puts them: on the last chunk, before the loss."""
    head, sep, tail = layout.rpartition("L")
    return head + "m" * mtp_depth + sep + tail if mtp_depth else layout


def _recompute_args(plan: Plan) -> list[str]:
    recompute, _ = recompute_setting(plan)
    if recompute in ("selective", "op"):  # op: Megatron-LM's nearest (a note says so)
        return ["--recompute-granularity", "selective"]
    if recompute == "full":
        method = plan.data.get("recompute_method") or "uniform"
        count = str(plan.data.get("recompute_num_layers") or 1)
        return [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            method,
            "--recompute-num-layers",
            count,
        ]
    return []


def core_notes(plan: Plan, trainer: str, rotary: str, pads: bool = True) -> list[str]:
    """What a Megatron-Core trainer builds differently from the plan's model: an older plan's assumed
    fields, a padded vocabulary of another multiple (where the trainer ``pads``), a rotary base that is
    not an integer (``rotary``: the trainer's name for it)."""
    arch = architecture(plan["model"])
    out = list(arch.assumed)
    spec, tp = arch.spec, int(plan["tp"])
    multiple = VOCAB_MULTIPLE * tp
    if pads and -(-spec.vocab // multiple) * multiple != arch.padded_vocab:
        out.append(
            f"the plan prices a padded vocabulary of {arch.padded_vocab}; {trainer} pads {spec.vocab} "
            f"to a multiple of {multiple}"
        )
    if arch.position_embedding == "rope" and spec.rope_theta != int(spec.rope_theta):
        out.append(f"{trainer}'s {rotary} is an integer; the plan's is {spec.rope_theta}")
    return out


def world_note(plan: Plan) -> str:
    """Data parallelism from the world size, as Megatron-LM and Megatron-Bridge derive it."""
    return (
        f"data parallelism is the world size over tp·cp·pp: launch {plan_world(plan)} processes for dp "
        f"{plan['dp']}"
    )


def megatron_notes(plan: Plan) -> list[str]:
    """What Megatron-LM cannot take from the flags (:func:`core_notes`, the model's vocabulary source,
    the world size)."""
    out = core_notes(plan, "Megatron-LM", "--rotary-base")
    out.append(
        "Megatron-LM takes the vocabulary from its tokenizer: --vocab-size applies with --tokenizer-type "
        "NullTokenizer; with another tokenizer check that its vocabulary is "
        f"{plan['model']['vocab']}"
    )
    out.append(world_note(plan))
    return out + notes(plan, "megatron")


def plan_world(plan: Plan) -> int:
    """tp · cp · pp · dp: the processes the plan runs on."""
    return int(plan["tp"]) * int(plan.data.get("cp", 1)) * int(plan["pp"]) * int(plan["dp"])


def megatron_text(plan: Plan, source: str = "plan") -> str:
    """A shell fragment: comment lines (the plan, the notes) and ``MEGATRON_ARGS=(…)``."""
    args = megatron_args(plan)
    lines = [f"# Megatron-LM (core_r0.16) arguments of {source}: {summary(plan)}"]
    lines += [f"# note: {n}" for n in megatron_notes(plan)]
    lines.append("MEGATRON_ARGS=(")
    i = 0
    while i < len(args):
        pair = i + 1 < len(args) and not args[i + 1].startswith("--")
        lines.append("  " + " ".join(shlex.quote(a) for a in args[i : i + (2 if pair else 1)]))
        i += 2 if pair else 1
    lines.append(")")
    return "\n".join(lines) + "\n"
