"""Context parallelism's sequence split, applied to the model, the data and the gradients.

- :func:`local_positions`: the global positions rank r of ``cp`` holds: chunks r and 2·cp−1−r of the
  2·cp chunks of length S/(2·cp) (causal load balancing; :mod:`pipewright.runtime.parallel.cp.ring`).
- :func:`shard_sequence`: a [b, S, …] batch (token ids, targets) cut to those positions.
- :func:`apply_context_parallel`: a built stage made context-parallel, without changing its parameters
  or their names: every :class:`~pipewright.models.blocks.AttentionCore` becomes a
  :class:`~pipewright.runtime.parallel.cp.ring.RingAttentionCore`; a learned position table (GPT) is indexed
  at
  the global positions (a forward pre-hook maps 0…S/cp−1 to them); rotary tables (Llama, buffers
  ``cos``/``sin`` read as ``[:s]``) keep only the rows of those positions.
- Mixture-of-experts layers route their own tokens; their load-balancing counts are summed over the
  cp ranks (:func:`summed_over`; :mod:`pipewright.models.moe_mlp`).
- :class:`ContextParallel`: all of it for one trainer (its ring from the mesh's cp coordinate).
- :func:`sync_context_parallel_grads`: the parameter gradients averaged over the cp group. Each rank's
  loss is the mean over its S/cp tokens and every rank holds as many, so the mean over the cp ranks is
  the mean over the whole sequence; its gradient is the average of the ranks' gradients (the ring's
  backward has already carried every rank's dK/dV contributions home). Averaging over cp then over dp
  is averaging over the dp × cp replicas, as Megatron-LM reduces over its data-and-context group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipewright.errors import ConfigError
from pipewright.models.blocks import AttentionCore
from pipewright.models.moe_mlp import moe_layers
from pipewright.runtime.parallel.cp.overlap import PairOverlap, install_pair_overlap
from pipewright.runtime.parallel.cp.ring import DistRing, Ring, RingAttentionCore
from pipewright.runtime.reliability.timeouts import new_group


def check_context_parallel(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """One-line ConfigError unless cp ≥ 1 and S splits into 2·cp equal chunks (and, with sequence
    parallelism, the S/cp local tokens split over tp)."""
    if cp < 1:
        raise ConfigError(f"--cp must be at least 1 (got {cp})")
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"--seq-len {seq_len} does not split into 2·cp = {2 * cp} equal chunks (--cp {cp}); "
            f"choose a sequence length divisible by {2 * cp}"
        )
    if cp > 1 and sequence_parallel and (seq_len // cp) % tp:
        raise ConfigError(
            f"--cp {cp} leaves {seq_len // cp} tokens per rank, not divisible by --tp {tp} "
            "for --sequence-parallel"
        )


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (int64, increasing) of context-parallel rank ``rank``'s tokens."""
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` [b, S, …] at ``positions`` along the sequence: [b, S/cp, …]."""
    return x.index_select(1, positions.to(x.device))


def _global_positions_hook(positions: torch.Tensor):
    def hook(module: nn.Module, args: tuple) -> tuple:
        idx = args[0]
        return (positions.to(idx.device)[idx], *args[1:])

    return hook


def summed_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """A MoE layer's ``count_sum``: its per-expert counts summed over ``group`` (the cp ranks)."""

    def count_sum(counts: torch.Tensor) -> torch.Tensor:
        total = counts.clone()
        dist.all_reduce(total, group=group)
        return total

    return count_sum


def apply_context_parallel(
    stage: nn.Module,
    ring: Ring,
    positions: torch.Tensor,
    count_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> nn.Module:
    """Make ``stage`` attend over the ring and place its tokens at ``positions`` (module docstring);
    its MoE layers' balance counts summed by ``count_sum`` (:mod:`pipewright.models.moe_mlp`); returns it
    (modified in place)."""
    for layer in moe_layers(stage):
        layer.count_sum = count_sum
    for module in list(stage.modules()):
        for name, child in list(module.named_children()):
            if type(child) is AttentionCore:
                setattr(module, name, RingAttentionCore(ring))
        for table in ("cos", "sin"):  # rotary tables, read as [:s]
            if table in module._buffers:
                buf = module._buffers[table]
                module._buffers[table] = buf[positions.to(buf.device)]
    embed = getattr(stage, "embed", None)
    pos = getattr(embed, "pos", None)
    if isinstance(pos, nn.Embedding):  # a learned position table
        pos.register_forward_pre_hook(_global_positions_hook(positions))
    return stage


def sync_context_parallel_grads(modules: Iterable[nn.Module], group: dist.ProcessGroup, cp: int) -> None:
    """Average every parameter gradient of ``modules`` over the cp ``group`` (one flat all-reduce;
    a parameter without a gradient counts as zeros)."""
    params = [p for mod in modules for p in mod.parameters() if p.requires_grad]
    if cp == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= cp
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def _second_cp_group(mesh) -> dist.ProcessGroup | None:
    """Collective over all ranks: a second group over this rank's cp ring (every ring's, created in
    one order), for the ring's backward exchanges."""
    mine = None
    for d in range(mesh.dp):
        for p in range(mesh.pp):
            for t in range(mesh.tp):
                ranks = [mesh.process_of(d, p, t, c) for c in range(mesh.cp)]
                group = new_group(ranks)
                if mesh.rank in ranks:
                    mine = group
    return mine


@dataclass
class ContextParallel:
    """One trainer's context parallelism: the cp group, its size and this rank's positions."""

    group: dist.ProcessGroup
    cp: int
    positions: torch.Tensor
    ring: DistRing | None = None
    pair_overlap: PairOverlap | None = None  # set by :meth:`overlap`
    grad_syncs: int = 0  # the gradient all-reduces over cp alone (none where dp × cp reduces once)

    @classmethod
    def of(cls, mesh, seq_len: int, stages: Mapping[int, nn.Module]) -> ContextParallel | None:
        """Apply context parallelism to ``stages`` (built, on the mesh's device) over ``mesh``'s cp
        ring (a :class:`~pipewright.runtime.parallel.process_mesh.ParallelMesh`); None when cp = 1."""
        if getattr(mesh, "cp", 1) == 1:
            return None
        check_context_parallel(seq_len, mesh.cp)
        c, cp = mesh.cp_rank, mesh.cp
        d, p, t = mesh.coords
        ring = DistRing(
            mesh.cp_group,
            c,
            cp,
            mesh.process_of(d, p, t, (c + 1) % cp),
            mesh.process_of(d, p, t, (c - 1) % cp),
            back_group=_second_cp_group(mesh),
        )
        positions = local_positions(seq_len, cp, c, mesh.device)
        for stage in stages.values():
            apply_context_parallel(stage, ring, positions, summed_over(mesh.cp_group))
        return cls(mesh.cp_group, cp, positions, ring)

    def overlap(self, executor, config, mesh) -> None:
        """Overlap the schedule's F&B pairs on ``executor`` (:mod:`.overlap`) unless
        ``config.blocking_pairs``, tensor parallelism or recomputation (one after the other then)."""
        self.pair_overlap = install_pair_overlap(executor, config, mesh)

    def shard(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each [b, S] microbatch at this rank's positions: [b, S/cp]."""
        return [shard_sequence(x, self.positions) for x in batches]

    def sync_grads(self, modules: Iterable[nn.Module], reduced: bool = False) -> None:
        """Average the gradients over the cp ranks, unless ``reduced``: the data-parallel reduction
        already averaged them over dp × cp in one all-reduce (``ParallelMesh.grad_group``)."""
        if not reduced:
            sync_context_parallel_grads(modules, self.group, self.cp)
            self.grad_syncs += 1

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of ``value`` over the cp ranks (collective over the cp group)."""
        total = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.group)
        return total.item() / self.cp
