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
#: the attention kinds of the cost model (:data:`pipewright.cost.attention_kinds.ATTENTION_KINDS`)
ATTENTION_KIND_NAMES = ("mha", "mla")
#: the ModelSpec fields the MoE flags set (``--moe-experts`` → ``moe_experts``), with the cost model's
#: attention kind and multi-token-prediction depth
_MOE_SHAPE = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_ffn_hidden", "moe_dense_layers")
MOE_FIELDS = (*_MOE_SHAPE, "attention_kind", "mtp_depth")


#: the cost-model fields the flags of :func:`add_cost_options` set, and their defaults
COST_FIELDS = {
    "grad_dtype": None,
    "kernels": None,
    "fsdp_grad_sync": None,
    "stage_outputs": None,
    "cp_comm": None,
}


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


def recompute_fields(args: argparse.Namespace) -> dict[str, object]:
    """The cost-model fields of :func:`add_recompute_method`'s flags that were given."""
    names = ("recompute_method", "recompute_num_layers")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def tp_comm_overlap(args: argparse.Namespace) -> str:
    """The mode ``--tp-comm-overlap`` prices under ``--framework``
    (:func:`pipewright.cost.frameworks.tp_comm_overlap`): ``none`` without the flag."""
    from pipewright.cost.frameworks import tp_comm_overlap as resolve

    return resolve(getattr(args, "tp_comm_overlap", False), getattr(args, "framework", None))


def cost_fields(args: argparse.Namespace) -> dict[str, object]:
    """The cost-model fields the user set with :func:`add_cost_options`' flags (defaults left out)."""
    return {k: getattr(args, k) for k, default in COST_FIELDS.items() if getattr(args, k, default) != default}
