"""The router load-balancing loss of Hugging Face mixtures of experts (Mixtral, Qwen2-MoE) across
pipeline stages, as ``transformers`` computes it (``load_balancing_loss_func``, with
``output_router_logits: true``):

    aux = E · Σₑ (Tₑ / R) · (Pₑ / R),   loss = cross-entropy + c · aux

over the router logits of all MoE layers at once: Tₑ the number of (token, slot) pairs whose top-k
(by softmax probability) holds expert e, Pₑ the summed softmax probability of e, R = layers × tokens,
E experts, c = ``router_aux_loss_coef``. The sums couple every stage's layers (not a sum of per-layer
losses), so each stage adds its layers' T/N, P/N (N tokens) and layer count to a *carry* — 2E + 1
numbers in ``rows(E, h)`` extra rows appended to the hidden state [b, s, h] → [b, s + r, h] that it
sends on — and the last stage forms ``aux`` from the totals and hangs c · aux on its logits (tensor
attribute ``router_aux_loss``), which :func:`loss_with_router_aux` adds to the cross-entropy. P flows
through the carry, so the gradient reaches every stage's routers through the pipeline's own backward;
T is a count (no gradient), as in ``transformers``. Per microbatch, as ``transformers`` with gradient
accumulation. The router logits are read by a forward hook on the module class ``transformers``
records them from (``_can_record_outputs["router_logits"]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

#: The tensor attribute the last stage's logits carry c · aux on.
ATTRIBUTE = "router_aux_loss"


@dataclass(frozen=True)
class RouterLoss:
    """A model's load-balancing loss: E experts, top-k, coefficient c, the router module class and the
    index of its logits in that module's output."""

    experts: int
    top_k: int
    coeff: float
    router: type
    index: int

    def carry_size(self) -> int:
        return 2 * self.experts + 1


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The loss ``transformers`` adds for ``model`` (None: a dense model, or ``output_router_logits``
    false)."""
    config = model.config
    count = experts(config)
    if not count or not getattr(config, "output_router_logits", False):
        return None
    recorder = None
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            break
    if recorder is None:
        return None
    return RouterLoss(
        count,
        int(config.num_experts_per_tok),
        float(config.router_aux_loss_coef),
        recorder.target_class,
        int(recorder.index),
    )


def experts(hf_config) -> int:
    """The routed experts of a ``transformers`` config (0: dense)."""
    return int(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0)


def rows(experts: int, hidden: int) -> int:
    """Extra rows of the hidden state that hold the carry (2E + 1 numbers)."""
    return math.ceil((2 * experts + 1) / hidden)


def stage_sums(loss: RouterLoss, logits: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[T/N (E), P/N (E), layers] of this stage's MoE layers' router ``logits`` ([N, E] each)."""
    out = torch.zeros(loss.carry_size(), dtype=torch.float32, device=device)
    for layer in logits:
        probs = torch.softmax(layer.float(), dim=-1)
        _, chosen = torch.topk(probs, loss.top_k, dim=-1)
        counts = torch.zeros(loss.experts, dtype=torch.float32, device=probs.device)
        counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
        n = probs.shape[0]
        out = out + torch.cat([counts / n, probs.sum(dim=0) / n, torch.ones(1, device=probs.device)])
    return out


def aux_loss(loss: RouterLoss, totals: torch.Tensor) -> torch.Tensor:
    """c · E · Σₑ (Tₑ/R)(Pₑ/R) from the totals [Σ T/N, Σ P/N, layers] (R/N = layers)."""
    e, layers = loss.experts, totals[-1].clamp_min(1.0)
    return loss.coeff * e * torch.sum((totals[:e] / layers) * (totals[e : 2 * e] / layers))


def attach(x: torch.Tensor, carry: torch.Tensor, extra: int) -> torch.Tensor:
    """Hidden state [b, s, h] with ``carry`` in ``extra`` rows after the sequence → [b, s + extra, h]."""
    b, _, h = x.shape
    block = torch.zeros(extra * h, dtype=x.dtype, device=x.device)
    block = torch.cat([carry.to(x.dtype), block[carry.numel() :]]).view(1, extra, h).expand(b, extra, h)
    return torch.cat([x, block], dim=1)


def split_carry(x: torch.Tensor, loss: RouterLoss, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden state and the carry (from the first sequence of the microbatch) of a stage's input."""
    carry = x[0, -extra:].reshape(-1)[: loss.carry_size()].float()
    return x[:, :-extra], carry


def loss_with_router_aux(base):
    """``base`` (cross-entropy) plus the router loss the logits carry (:data:`ATTRIBUTE`), if any."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = base(logits, targets)
        aux = getattr(logits, ATTRIBUTE, None)
        return value if aux is None else value + aux

    return loss_fn
