"""A mixture-of-experts MLP (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch Transformer,
Fedus et al. 2022), the layer both model families use in place of their MLP when ``spec.moe_experts``
> 0.

For the T = b·s tokens of one microbatch (x ∈ ℝ^{T×h}):

1. Router: logits z = x·W_rᵀ ∈ ℝ^{T×E} (fp32), probabilities p = softmax(z); each token picks its k
   experts of largest p. Gate weights: the k probabilities renormalised to sum to 1 when k > 1
   (Mixtral), the probability itself when k = 1 (Switch).
2. Capacity (``moe_capacity`` F > 0): expert i keeps at most C = ⌈F·T·k/E⌉ assignments, in token
   order (GShard); a dropped assignment contributes nothing (the token keeps its residual).
   F = 0: dropless.
3. Dispatch: the kept (token, expert) assignments sorted by expert; each expert's MLP runs on its
   contiguous block. Under expert parallelism (``exchange``, :class:`TokenExchange`) rank r of the ep
   group holds experts [r·E/ep, (r+1)·E/ep): the blocks go to their owners by all-to-all, come back by
   the reverse all-to-all.
4. Combine: y_t = Σ_{kept (t, i)} g_{t,i}·Expert_i(x_t) + Shared(x_t), where the ``moe_shared_experts``
   shared experts are one MLP of S·f_e hidden units that every token passes through (DeepSeekMoE).

Auxiliary losses, per layer and microbatch: load balance L_bal = E·Σᵢ fᵢ·Pᵢ with fᵢ the fraction of the
T·k assignments routed to expert i (before dropping) and Pᵢ the mean router probability of expert i
(Switch Transformer eq. 4; 1 when perfectly balanced); router z-loss L_z = mean_t (logsumexp z_t)²
(ST-MoE, Zoph et al. 2022). The layer adds α·L_bal + β·L_z to the objective through
:class:`AuxLossScaler`: its forward returns the layer output unchanged and its backward adds
``aux_grad_scale`` · ∂(α·L_bal + β·L_z) to the gradients (Megatron-LM's MoEAuxLossAutoScaler). The
gradient therefore flows in whichever backward passes through the layer — any schedule, split I/W
included — with no extra channel between stages; the runtime sets ``aux_grad_scale`` to the main loss's
1/m (and the fp16 loss scale). Values are recorded (detached) in ``records`` while gradients are on.

Context parallelism (``count_sum``, set by the runtime): each cp rank routes only its own S/cp tokens
of the microbatch. Routing and the experts are per token, so they are unchanged; fᵢ, a ratio of counts,
is made the whole microbatch's by summing the counts over the cp ranks (no gradient flows through
it), while Pᵢ stays the local mean. The local L_bal = E·Σᵢ fᵢ·Pᵢ^local then averages over the cp
ranks (equal token counts) to the whole microbatch's E·Σᵢ fᵢ·Pᵢ, as L_z's local means average to its
mean, so averaging gradients over cp gives the single-sequence gradient. A capacity would cap each
rank's own tokens: the runtime refuses one under cp.

Initialisation: the router N(0, 0.02²); expert e's weights from a generator of its own, seeded from the
layer's generator and e, so an expert's initial weights do not depend on which experts a rank holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipewright.models.spec import ModelSpec


class TokenExchange(Protocol):
    """Expert parallelism's communication (implemented by
    :mod:`pipewright.runtime.parallel.moe_parallel`): ``size`` ranks, this one ``rank``; ``counts(send)``
    exchanges the per-expert token counts (send: [E] int64, experts in rank order; returns [size, E/size]:
    what each rank sends to each of my experts);
    ``tokens(x, send_splits, recv_splits)`` an all-to-all of rows (differentiable: its backward is the
    reverse all-to-all)."""

    size: int
    rank: int

    def counts(self, send: torch.Tensor) -> torch.Tensor: ...

    def tokens(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor: ...


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; backward passes the output gradient through and gives ``aux`` (a scalar
    loss) the gradient ``scale``, so ∂(scale·aux) reaches the router in the layer's own backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def route(
    logits: torch.Tensor,
    k: int,
    capacity: float,
    count_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of logits [T, E]: (expert [T·k], token [T·k], gate [T·k], kept [T·k] bool,
    load-balancing loss E·Σ fᵢPᵢ); assignments token-major (token t's k choices at t·k … t·k+k−1).
    ``count_sum``: the per-expert assignment counts summed over the shards of the sequence (context
    parallelism), so that fᵢ is the whole microbatch's (module docstring)."""
    tokens, experts = logits.shape
    probs = logits.softmax(-1)
    top_p, top_i = probs.topk(k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
    expert = top_i.reshape(-1)
    token = torch.arange(tokens, device=logits.device).repeat_interleave(k)
    counts = torch.bincount(expert, minlength=experts)
    if count_sum is not None:
        counts = count_sum(counts)
    balance = experts * (counts.to(probs.dtype) / counts.sum() * probs.mean(0)).sum()
    kept = torch.ones_like(expert, dtype=torch.bool)
    if capacity > 0:
        cap = math.ceil(capacity * tokens * k / experts)
        one_hot = F.one_hot(expert, experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # this assignment's place at its expert
        kept = position < cap
    return expert, token, gates.reshape(-1), kept, balance


def _generator(gen: torch.Generator, base: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((base * 1_000_003 + index) & ((1 << 63) - 1))


class _RouterLinear(torch.autograd.Function):
    """The router's logits x·W_rᵀ in fp32, as ``F.linear(x.float(), W_r.float())`` computes them and its
    gradients, keeping x and W_r in their own dtype for the backward (autograd would keep the fp32
    copy of x, twice the 16-bit input's bytes; Megatron-LM's router gating keeps the input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.mm(weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class _Combine(torch.autograd.Function):
    """y = 0.index_add(0, token, weighted): each assignment's weighted output summed into its token's
    row. Its gradient is ∂y gathered back, ∂y[token]; PyTorch's ``index_add`` keeps ``weighted`` (a
    k·T×h tensor) for its backward, for nothing but its shape — kept here are the indices alone."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, token: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token)
        return torch.zeros_like(like).index_add(0, token, weighted)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token,) = ctx.saved_tensors
        return None, None, grad.index_select(0, token)


def _combine(like: torch.Tensor, token: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    """:class:`_Combine` (the rows of ``like``'s shape)."""
    return _Combine.apply(like.detach(), token, weighted)


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of an MLP; see the module docstring.

    ``make_mlp(ffn_hidden)`` builds one expert MLP (the family's own MLP class with that hidden size);
    ``init_mlp(module, generator, ffn_hidden)`` initialises one. ``exchange``: expert parallelism (None:
    every expert here). Parameter names are global: ``router.weight``, ``experts.<e>.…`` with e the
    global expert index, ``shared.…``."""

    def __init__(
        self,
        spec: ModelSpec,
        make_mlp: Callable[[int], nn.Module],
        init_mlp: Callable[[nn.Module, torch.Generator, int], None],
        exchange: TokenExchange | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.num_experts, self.top_k = spec.moe_experts, spec.moe_top_k
        self.exchange = exchange
        size, rank = (exchange.size, exchange.rank) if exchange is not None else (1, 0)
        self.local = range(rank * self.num_experts // size, (rank + 1) * self.num_experts // size)
        self.router = nn.Linear(spec.hidden, self.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(spec.expert_ffn) for e in self.local})
        shared = spec.moe_shared_experts * spec.expert_ffn
        self.shared = make_mlp(shared) if shared else None
        self.init_mlp = init_mlp
        self.aux_grad_scale = 1.0
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []  # (L_bal, L_z) per forward
        self.count_sum: Callable[[torch.Tensor], torch.Tensor] | None = None  # cp: module docstring

    def reset_parameters(self, gen: torch.Generator) -> None:
        base = int(torch.randint(0, 1 << 62, (1,), generator=gen))
        with torch.no_grad():
            w = torch.randn(self.num_experts, self.spec.hidden, generator=_generator(gen, base, 0)) * 0.02
            self.router.weight.copy_(w)
        for e, expert in self.experts.items():
            self.init_mlp(expert, _generator(gen, base, 1 + int(e)), self.spec.expert_ffn)
        if self.shared is not None:
            ffn = self.spec.moe_shared_experts * self.spec.expert_ffn
            self.init_mlp(self.shared, _generator(gen, base, 1 + self.num_experts), ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = _RouterLinear.apply(flat, self.router.weight)
        capacity = self.spec.moe_capacity
        expert, token, gate, kept, balance = route(logits, self.top_k, capacity, self.count_sum)
        expert, token, gate = expert[kept], token[kept], gate[kept]
        order = torch.argsort(expert, stable=True)
        expert, token, gate = expert[order], token[order], gate[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        routed = self._experts(flat[token], counts)
        out = _combine(flat, token, routed * gate.unsqueeze(-1).to(routed.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.view(shape)
        if not torch.is_grad_enabled():
            return out
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.records.append((balance.detach(), z.detach()))
        aux = self.spec.moe_aux_loss_coeff * balance + self.spec.moe_z_loss_coeff * z
        return AuxLossScaler.apply(out, aux, self.aux_grad_scale)

    def _run_local(self, x: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        """Each expert of ``experts`` on its block of ``x`` (blocks in expert order, sizes ``counts``)."""
        pieces = []
        for e, block in zip(experts, x.split(counts), strict=True):
            pieces.append(self.experts[str(e)](block) if block.shape[0] else block)
        return torch.cat(pieces) if pieces else x

    def _experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by expert (``counts`` per expert) → the experts' outputs, same order."""
        ex = self.exchange
        if ex is None or ex.size == 1:
            return self._run_local(x, counts.tolist(), self.local)
        per = self.num_experts // ex.size
        recv = ex.counts(counts)  # [ep, per]: rows each source rank sends to each of my experts
        send_splits = counts.view(ex.size, per).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        got = ex.tokens(x, send_splits, recv_splits)  # source-major, expert within
        # regroup source-major → expert-major, run, and put back in source-major order
        sizes = recv.reshape(-1).tolist()
        blocks = got.split(sizes)
        perm = [src * per + j for j in range(per) for src in range(ex.size)]
        by_expert = torch.cat([blocks[i] for i in perm]) if blocks else got
        done = self._run_local(by_expert, recv.t().sum(1).tolist(), self.local)
        out_blocks = done.split([sizes[i] for i in perm])
        back = [None] * len(perm)
        for i, block in zip(perm, out_blocks, strict=True):
            back[i] = block
        source_major = torch.cat(back) if back else done
        return ex.tokens(source_major, recv_splits, send_splits)


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters inside ``module`` (sharded over expert parallelism; the router
    and the shared experts are replicated like every dense parameter)."""
    return [p for m in moe_layers(module) for p in m.experts.parameters()]
