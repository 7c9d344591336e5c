"""Cost-model flags shared by ``pipewright simulate`` and ``pipewright plan``: the attention kernel,
the mixture-of-experts shape (ModelSpec's ``moe_*`` fields), the expert-parallel size and the expert
load imbalance. Light on purpose: building a parser imports no numpy (``pipewright.cost`` does)."""

from __future__ import annotations

import argparse

#: the attention kernels with published rates (:data:`pipewright.cost.attention_kernels.KERNEL_NAMES`)
KERNEL_NAMES = ("fa2", "fa3", "cudnn")
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
