"""Mixture-of-experts in the training runtime: expert parallelism's all-to-all, the experts' gradient
reduction, the gradient norm over sharded experts, and the auxiliary losses' scale and report.

Expert parallelism (ep, carved from dp; :mod:`pipewright.mesh`): the ep ranks of a group hold
disjoint experts and run the same schedule on different data. In each MoE layer's forward a rank sends
every expert's tokens to the expert's owner (``all_to_all_single`` over the ep group, counts first),
the owners run their experts, and the reverse all-to-all brings the outputs back; the backward runs
the same two exchanges in reverse order (:class:`AllToAll`). Peers reach each exchange at the same
action of the same schedule, so any synchronous schedule stays deadlock-free.

Overlap (DualPipe's point for experts, :meth:`MoeRuntime.overlap`): under a schedule that marks F&B
pairs (DualPipeV), each pair's forward runs on a second thread while the backward of the other
microbatch runs on the main one (:mod:`pipewright.runtime.parallel.cp.overlap`), so one microbatch's dispatch
and combine all-to-alls wait while the other microbatch computes. The forward's exchanges run over the
mesh's ep group and the backward's over a second group of the same ranks (``ep_back_group``): two
threads never share a group, and each group sees its exchanges in one order on every peer. On gloo
each waiting all-to-all releases the interpreter's lock, so the other thread's kernels run meanwhile.
``--blocking-pairs`` runs the pairs one after the other (the blocking baseline).

Gradients (:func:`reduce_expert_grads`, the REDUCE_GRAD handler when ep > 1): a dense parameter is
averaged over the dp group as before, Σ_dp g / dp. An expert held by ep rank e already received the
tokens of its whole ep group, so its gradient is a sum over those ep replicas' losses; summing it over
the expert-data-parallel group (the dp/ep holders of the same expert) then covers all dp replicas, and
dividing by dp gives the gradient of the global mean loss — the same Σ / dp, over another group.

Gradient norm (:meth:`MoeRuntime.norm_params`): each element counted once when the squares are summed
over tp, pp and dp — dense parameters on dp rank 0, experts on the ranks of expert-data-parallel rank 0.

Auxiliary losses (:mod:`pipewright.models.moe_mlp`): each MoE layer injects ∂(α·L_bal + β·L_z) scaled by
``aux_grad_scale`` = S/m (m microbatches, S the fp16 loss scale, 1 otherwise), the scale of the main
loss's 1/m, so the data-parallel average makes it 1/(dp·m) like the main loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipewright.models.moe_mlp import expert_parameters, moe_layers
from pipewright.models.spec import ModelSpec
from pipewright.runtime.core.handlers import RunState
from pipewright.runtime.parallel.cp.overlap import PairOverlap, install_pair_overlap
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.profiling.wait_clock import WaitClock


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` in ``send`` blocks to the group's ranks, ``recv`` rows from each; backward: the
    reverse exchange of the gradient (blocks swapped), over the exchange's backward group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, send: list[int], recv: list[int], exchange: GroupExchange
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.exchange = send, recv, exchange
        out = x.new_empty((sum(recv), *x.shape[1:]))
        exchange.run(out, x.contiguous(), recv, send, backward=False)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.exchange.run(out, grad.contiguous(), ctx.send, ctx.recv, backward=True)
        return out, None, None, None


class GroupExchange:
    """:class:`pipewright.models.moe_mlp.TokenExchange` over a process group of ``size`` ranks; the
    backward's exchanges over ``back_group`` (a second group of the same ranks; default ``group``).
    ``waited``: seconds spent in the forward's (False) and the backward's (True) exchanges since reset
    (transfer and waiting for the peers: the communication a blocking run exposes)."""

    def __init__(self, group: Any, size: int, rank: int, back_group: Any = None) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.back_group = group if back_group is None else back_group
        self.waited = WaitClock()

    def run(
        self, out: torch.Tensor, x: torch.Tensor, out_splits: Any, in_splits: Any, backward: bool
    ) -> None:
        """One blocking ``all_to_all_single`` over the forward's or the backward's group, timed."""
        group = self.back_group if backward else self.group
        with self.waited.timing(backward, x.device):
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        """[E] counts in expert order → [size, E/size]: what each rank sends to each of my experts."""
        recv = torch.empty_like(send)
        self.run(recv, send.contiguous(), None, None, backward=False)
        return recv.view(self.size, -1)

    def tokens(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        return AllToAll.apply(x, send_splits, recv_splits, self)


def expert_parallel(mesh: ParallelMesh) -> GroupExchange | None:
    """The token exchange of this rank's ep group (None without expert parallelism)."""
    if mesh.ep <= 1:
        return None
    return GroupExchange(mesh.ep_group, mesh.ep, mesh.ep_rank, mesh.ep_back_group)


def reduce_expert_grads(state: RunState, action: Any) -> None:
    """REDUCE_GRAD with expert parallelism: the stage's dense gradients summed over dp (× cp: one
    all-reduce for both, ``ParallelMesh.grad_group``), its experts' over the expert-data-parallel
    group (× cp: ``ParallelMesh.expert_grad_group``), both asynchronously; the executor's
    ``finish_reduction`` divides each by dp · cp (module docstring)."""
    ex, stage = state.executor, action.stage
    module = ex.stages[stage]
    experts = {id(p) for p in expert_parameters(module)}
    params = [p for p in module.parameters() if p.requires_grad]
    for key, group, mine in (
        (stage, ex.mesh.grad_group, [p for p in params if id(p) not in experts]),
        ((stage, "experts"), ex.mesh.expert_grad_group, [p for p in params if id(p) in experts]),
    ):
        if not mine:
            continue
        for p in mine:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in mine]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=group, async_op=True)
        state.reductions[key] = (work, flat, grads, ex.mesh.grad_replicas)


class MoeRuntime:
    """A trainer's mixture-of-experts duties on this rank's ``stages`` (build when the model has
    experts): the aux-loss gradient scale before each run, the norm's parameters and groups, and the
    step's auxiliary-loss report (collective over pp and dp)."""

    def __init__(
        self, spec: ModelSpec, mesh: ParallelMesh, stages: Mapping[int, nn.Module], microbatches: int
    ):
        self.spec, self.mesh, self.microbatches = spec, mesh, microbatches
        self.layers = [m for mod in stages.values() for m in moe_layers(mod)]
        self.experts = {id(p) for mod in stages.values() for p in expert_parameters(mod)}
        self.pair_overlap: PairOverlap | None = None  # set by :meth:`overlap`

    def overlap(self, executor: Any, config: Any) -> None:
        """With expert parallelism, run ``executor``'s F&B pairs overlapped (module docstring), unless
        ``config.blocking_pairs`` (or tp, recomputation: :func:`install_pair_overlap`)."""
        if self.mesh.ep > 1:
            self.pair_overlap = install_pair_overlap(executor, config, self.mesh)

    def before_run(self, loss_scale: float = 1.0) -> None:
        """Set every MoE layer's aux-loss gradient scale to S/m and forget the last step's records."""
        for layer in self.layers:
            layer.aux_grad_scale = loss_scale / self.microbatches
            layer.records.clear()

    def norm_params(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` that this rank counts in a norm summed over tp, pp and dp (module docstring)."""
        if self.mesh.ep <= 1:
            return list(params)
        dense_here = self.mesh.dp_rank == 0
        experts_here = self.mesh.dp_rank < self.mesh.ep
        return [p for p in params if (experts_here if id(p) in self.experts else dense_here)]

    def norm_groups(self, groups: Sequence[Any]) -> list[Any]:
        """The groups a norm sums over: ``groups`` (tp, pp), plus dp under expert parallelism."""
        return [*groups, self.mesh.dp_group] if self.mesh.ep > 1 else list(groups)

    def report(self) -> dict[str, float]:
        """``moe_aux_loss``: Σ over MoE layers of α·L_bal + β·L_z, the mean over microbatches and
        replicas (what the auxiliary losses add to the step's loss); ``moe_balance``: L_bal averaged
        over layers, microbatches and replicas (1 = perfectly balanced). Collective over pp, dp and
        cp (each cp rank's values are its share of the sequence's: :mod:`pipewright.models.moe_mlp`)."""
        a, b = self.spec.moe_aux_loss_coeff, self.spec.moe_z_loss_coeff
        bal = sum((float(r[0]) for layer in self.layers for r in layer.records), 0.0)
        aux = sum((a * float(r[0]) + b * float(r[1]) for layer in self.layers for r in layer.records), 0.0)
        total = torch.tensor([aux, bal], dtype=torch.float64, device=self.mesh.device)
        for group in (self.mesh.pp_group, self.mesh.dp_group, self.mesh.cp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        runs = self.mesh.dp * self.mesh.cp * self.microbatches
        return {
            "moe_aux_loss": float(total[0]) / runs,
            "moe_balance": float(total[1]) / (runs * max(self.spec.moe_layers, 1)),
        }
