"""Cost-model flags shared by ``pipewright simulate`` and ``pipewright plan``: the attention kernel,
the mixture-of-experts shape (ModelSpec's ``moe_*`` fields), the expert-parallel size and the expert
load imbalance, the gradient buffer's dtype, the training framework (``--framework``). Light on
purpose: building a parser imports no numpy (``pipewright.cost`` does)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipewright.cost.efficiency import Efficiency
    from pipewright.hardware import Accelerator

#: the attention kernels with published rates (:data:`pipewright.cost.attention_kernels.KERNEL_NAMES`)
KERNEL_NAMES = ("fa2", "fa3", "cudnn")
#: the context-parallel implementations (:func:`pipewright.cost.cp_impls.names`), the default first
CP_COMM_NAMES = ("transformer-engine", "pipewright", "torch-allgather", "torch-alltoall", "llama3-allgather")
#: the --tp-comm-overlap modes (:func:`pipewright.cost.tp_overlap.modes`); the bare flag names the
#: --framework's own (:attr:`pipewright.cost.frameworks.Framework.tp_overlap`)
TP_OVERLAP_NAMES = ("none", "te", "async-tp")
#: --recompute modes of simulate (the planner searches none/selective/full)
RECOMPUTE_FLAGS = ("full", "selective", "op", "none")
RECOMPUTE_HELP = (
    "activation recomputation: full (the layer input kept), selective (the attention core re-run), "
    "op (torchtitan's operator-level policy: every second matmul and the memory-bound ops re-run), none"
)
#: Megatron-LM's --recompute-method choices (:data:`pipewright.cost.partial_recompute.RECOMPUTE_METHODS`)
RECOMPUTE_METHOD_NAMES = ("uniform", "block")
#: the attention kinds of the cost model (:data:`pipewright.cost.attention_kinds.ATTENTION_KINDS`)
ATTENTION_KIND_NAMES = ("mha", "mla")
#: the ModelSpec fields the MoE flags set (``--moe-experts`` → ``moe_experts``), with the cost model's
#: attention kind and multi-token-prediction depth
_MOE_SHAPE = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_ffn_hidden", "moe_dense_layers")
MOE_FIELDS = (*_MOE_SHAPE, "attention_kind", "mtp_depth")


def add_moe_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, ep: bool = True, imbalance: bool = True
) -> None:
    """``--moe-experts --moe-top-k --moe-shared-experts --moe-ffn-hidden --moe-dense-layers
    --attention-kind --mtp-depth`` (default: the preset's), and with ``ep``/``imbalance`` ``--ep`` and
    ``--moe-imbalance``."""
    helps = {
        "moe_experts": "routed experts E (a mixture of experts; default: the preset's)",
        "moe_top_k": "experts per token k",
        "moe_shared_experts": "experts every token passes through (DeepSeekMoE)",
        "moe_ffn_hidden": "FFN width of one expert (default: --ffn-hidden)",
        "moe_dense_layers": "first layers that keep the dense MLP (DeepSeek-V3: 3)",
    }
    for name, text in helps.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name, help=text)
    parser.add_argument(
        "--attention-kind",
        choices=ATTENTION_KIND_NAMES,
        default=None,
        help="attention block: mha, or mla (DeepSeek's multi-head latent attention; default: the preset's)",
    )
    parser.add_argument(
        "--mtp-depth",
        type=int,
        default=None,
        help="multi-token-prediction modules on the last stage (DeepSeek-V3: 1; default: the preset's)",
    )
    if ep:
        parser.add_argument(
            "--ep", type=int, default=1, help="expert-parallel size, carved from --dp (experts split over it)"
        )
    if not imbalance:
        return
    parser.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="expert load imbalance: the busiest device's expert tokens over the even split (≥ 1)",
    )


#: the cost-model fields the flags of :func:`add_cost_options` set, and their defaults
COST_FIELDS = {
    "grad_dtype": None,
    "kernels": None,
    "fsdp_grad_sync": None,
    "stage_outputs": None,
    "cp_comm": None,
}


def add_cost_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Inputs on how the framework runs, on ``pipewright simulate`` and ``pipewright plan`` (which prices
    every candidate with them: ``plan.problem.Problem.cost_fields``):
    ``--grad-dtype fp32|bf16``: the gradient buffer's element type (its memory, and the data-parallel
    reduction's bytes: :func:`pipewright.cost.sharding.reduction_bytes`);
    ``--kernels fused|eager|compiled``: how the memory-bound kernels run (:mod:`pipewright.cost.kernels`);
    ``--fsdp-grad-sync microbatch|step``: when pipelined FSDP reduce-scatters the gradients
    (:mod:`pipewright.cost.sharding`);
    ``--stage-outputs freed|kept|step``: whether a stage frees each microbatch's output after sending it
    (:mod:`pipewright.cost.chunk_memory`);
    ``--cp-comm NAME``: how context-parallel attention exchanges K/V (:mod:`pipewright.cost.cp_impls`)."""
    parser.add_argument(
        "--grad-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="gradient buffer dtype (default fp32, Megatron-LM's; bf16 is Megatron-Core's grad_reduce_in_fp32"
        "=False, NeMo/Megatron-Bridge performance recipes): its memory and the data-parallel reduction's "
        "bytes (fp16 runs reduce in 16 bits, Megatron's default)",
    )
    parser.add_argument(
        "--kernels",
        choices=("fused", "eager", "compiled"),
        default=None,
        help="memory-bound kernels: fused (Megatron/Transformer Engine; the default), eager (PyTorch eager: "
        "one kernel per operator, fp32 cross-entropy) or compiled (torch.compile'd blocks, eager loss)",
    )
    parser.add_argument(
        "--fsdp-grad-sync",
        choices=("microbatch", "step"),
        default=None,
        help="with --fsdp and --pp > 1: gradients reduce-scattered every microbatch (sharded; the default) "
        "or once per step (held unsharded until then: torch.distributed.pipelining with FSDP2)",
    )
    parser.add_argument(
        "--stage-outputs",
        choices=("freed", "kept", "step"),
        default=None,
        help="each microbatch's stage output after its send: freed (Megatron's deallocation, Llama 3; the "
        "default), kept until its backward (pipewright train) or until the step ends, with a receive "
        "buffer per microbatch (torch.distributed.pipelining, torchtitan)",
    )
    parser.add_argument(
        "--cp-comm",
        choices=CP_COMM_NAMES,
        default=None,
        help="with --cp > 1, the context-parallel attention priced: transformer-engine (Megatron-LM's p2p "
        "ring; the default), pipewright (this package's ring), torch-allgather / torch-alltoall (PyTorch's "
        "context_parallel with that rotate method, K/V repeated to the query heads as torchtitan calls it; "
        "torchtitan's default: allgather), llama3-allgather (Llama 3: GQA K/V all-gathered, exposed)",
    )
    parser.add_argument(
        "--framework",
        action=_FrameworkAction,
        default=None,
        help="the training framework priced (pipewright.cost.frameworks: megatron, the default; torchtitan, "
        "llm-foundry, deepspeed-megatron): its default --kernels/--attention-kernel/--grad-dtype/"
        "--fsdp-grad-sync/--stage-outputs/--cp-comm (flags given win) and its fitted compute factor and "
        "per-layer overhead",
    )


class _FrameworkAction(argparse.Action):
    """``--framework NAME``: fills the inputs the framework sets by default where the user gave none
    (they default to None, so a flag given before or after wins); an unknown name is refused in one
    line when the command runs (:func:`framework_efficiency`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from pipewright.cost.frameworks import framework
        from pipewright.errors import ConfigError

        setattr(namespace, self.dest, values)
        try:
            defaults = framework(values).defaults
        except ConfigError:
            return
        for dest, value in defaults.items():
            if getattr(namespace, dest, None) is None:
                setattr(namespace, dest, value)


def framework_efficiency(args: argparse.Namespace, accelerators: Sequence[Accelerator]) -> Efficiency | None:
    """The calibration ``--framework`` prices on ``accelerators`` (one kind): the accelerator's defaults
    adjusted by the framework's fitted parameters; None for a framework that changes nothing (the
    default ``megatron``). One-line ConfigError for an unknown name or a cluster of mixed kinds."""
    from pipewright.cost.efficiency import default_efficiency
    from pipewright.cost.frameworks import framework
    from pipewright.errors import ConfigError

    fw = framework(getattr(args, "framework", None))
    if fw.neutral:
        return None
    kinds = {acc.name: acc for acc in accelerators}
    if len(kinds) != 1:
        mixed = ", ".join(kinds)
        raise ConfigError(f"--framework {fw.name} prices one accelerator kind; the cluster has {mixed}")
    return fw.efficiency(default_efficiency(next(iter(kinds.values()))))


def add_recompute_method(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, planner: bool = False
) -> None:
    """``--recompute-method uniform|block --recompute-num-layers N`` (with ``--recompute full``;
    :mod:`pipewright.cost.partial_recompute`)."""
    where = " (recorded in the plan file; the search prices plain full)" if planner else ""
    parser.add_argument(
        "--recompute-method",
        choices=RECOMPUTE_METHOD_NAMES,
        default=None,
        help="with --recompute full, Megatron-LM's --recompute-method: uniform (groups of N layers, only "
        "each group's input kept, the whole group re-run) or block (the first N layers of each chunk "
        f"recomputed, the rest keep their activations){where}",
    )
    parser.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="N for --recompute-method (1 ≤ N ≤ layers of the largest chunk; default 1)",
    )


def recompute_fields(args: argparse.Namespace) -> dict[str, object]:
    """The cost-model fields of :func:`add_recompute_method`'s flags that were given."""
    names = ("recompute_method", "recompute_num_layers")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def add_tp_comm_overlap(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--tp-comm-overlap [MODE]`` (:mod:`pipewright.cost.tp_overlap`) on ``simulate`` and ``plan``: a
    mode given wins; bare (stored as True), the ``--framework``'s own mode (:func:`tp_comm_overlap`).
    The mode is checked against the registered ones when the command runs (one line if unknown)."""
    parser.add_argument(
        "--tp-comm-overlap",
        nargs="?",
        const=True,
        default=False,
        metavar="MODE",
        help="tensor-parallel communication overlapped with GEMMs (MODE: "
        f"{', '.join(TP_OVERLAP_NAMES)}): te (Transformer Engine, behind all of a pass's GEMMs), async-tp "
        "(PyTorch's micro-pipeline pass: each collective with the matmul it fuses; the backward's "
        "input-gradient reduce-scatters exposed), none; bare, the --framework's "
        "own (megatron: te, torchtitan: async-tp)",
    )


def tp_comm_overlap(args: argparse.Namespace) -> str:
    """The mode ``--tp-comm-overlap`` prices under ``--framework``
    (:func:`pipewright.cost.frameworks.tp_comm_overlap`): ``none`` without the flag."""
    from pipewright.cost.frameworks import tp_comm_overlap as resolve

    return resolve(getattr(args, "tp_comm_overlap", False), getattr(args, "framework", None))


def add_microbatch_group(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, planner: bool = False
) -> None:
    """``--microbatch-group N``: Megatron-LM's microbatch group per virtual pipeline stage, on
    ``pipewright simulate`` and ``pipewright plan`` (:mod:`pipewright.plan.grouping`)."""
    where = (
        "every interleaved candidate runs groups of N (those with p > N or m < N are not searched; "
        "recorded in the plan file)"
        if planner
        else "default p"
    )
    parser.add_argument(
        "--microbatch-group",
        type=int,
        default=None,
        help="interleaved-1f1b: microbatches N that pass through each chunk together (p ≤ N ≤ m: "
        f"Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage, Llama 3 §3.3.2; {where})",
    )


def cost_fields(args: argparse.Namespace) -> dict[str, object]:
    """The cost-model fields the user set with :func:`add_cost_options`' flags (defaults left out)."""
    return {k: getattr(args, k) for k, default in COST_FIELDS.items() if getattr(args, k, default) != default}
