"""Input embedding and output layer tied across the first and the last pipeline stage (Megatron-LM).

When the two live on different stages, each of the two pipeline ranks holds its own copy of the [V, h]
table (the output layer's copy starts equal: ``build_stage`` initialises it from the embedding's
generator). After the backward, the two gradients are summed — an all-reduce over the group of the
first and the last stage's ranks of the same (dp, tp) replica, or a local add when one rank holds both
(V-shape schedules) — so both copies see ∂L/∂E = ∂L/∂E_input + ∂L/∂E_output, the tied model's
gradient, and the identical optimizer steps keep them equal. The copy on the last stage is left out of
the global gradient norm (the table is counted once). Under tensor parallelism the vocabulary-parallel
embedding and the column-parallel output layer hold the same rows [r·V/t, (r+1)·V/t) on tp rank r,
so the shards tie one to one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipewright.ir import Schedule
from pipewright.runtime.parallel.process_mesh import ParallelMesh


def _tied_group(mesh: ParallelMesh, first: int, last: int):
    """This rank's group of {first, last} pipeline ranks (created once per mesh; collective)."""
    cache = mesh.__dict__.setdefault("_tied_groups", {})
    if (first, last) not in cache:
        mine = None
        for d, t, c in mesh.replicas():
            ranks = [mesh.process_of(d, p, t, c) for p in (first, last)]
            group = dist.new_group(ranks)
            if mesh.rank in ranks:
                mine = group
        cache[(first, last)] = mine
    return cache[(first, last)]


class TiedEmbeddings:
    """Keeps the embedding table (stage 0) and the output weight (last stage) one tied tensor.

    Collective: construct on every rank. ``stages``: this rank's stage modules (``embed.tok`` on the
    first, ``head.out`` on the last stage)."""

    def __init__(self, schedule: Schedule, mesh: ParallelMesh, stages: Mapping[int, nn.Module]) -> None:
        last = schedule.num_stages - 1
        self.first_rank, self.last_rank = schedule.rank_of(0), schedule.rank_of(last)
        self.local = self.first_rank == self.last_rank
        self.group = None if self.local else _tied_group(mesh, self.first_rank, self.last_rank)
        self.embedding: nn.Parameter | None = stages[0].embed.tok.weight if 0 in stages else None
        self.output: nn.Parameter | None = stages[last].head.out.weight if last in stages else None
        self.active = self.embedding is not None or self.output is not None
        if self.embedding is not None and self.output is not None and self.embedding is self.output:
            self.active = False  # one stage holds both: already one Parameter

    def sync_grads(self) -> None:
        """Sum the two copies' gradients into both (call after the backward, before clipping)."""
        if not self.active:
            return
        if self.local:
            total = _grad(self.embedding) + _grad(self.output)
            for p in (self.embedding, self.output):  # in place: a .grad may be a view of a bucket buffer
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
            return
        param = self.embedding if self.embedding is not None else self.output
        param.grad = _grad(param)
        dist.all_reduce(param.grad, group=self.group)

    def excluded_from_norm(self) -> set[int]:
        """ids of the parameters to leave out of the global gradient norm (the output-layer copy)."""
        if self.active and self.output is not None and self.output is not self.embedding:
            return {id(self.output)}
        return set()


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
