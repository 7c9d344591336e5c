"""The trainer's training options in one place, so that the training loop calls them in a few lines:
activation recomputation (:mod:`.stage_recompute`), initial weights from a Hugging Face checkpoint
(:mod:`pipewright.models.hf_load`), embeddings tied across stages (:mod:`.tied`), mixed precision
(:mod:`.precision`) and the fp32-master / ZeRO-1 optimizer (:mod:`.zero`).

Order on construction: load weights (fp32, full precision) → tie → recompute → cast to the compute
dtype; the optimizer is built last over fp32 masters taken before the cast would lose precision (the
masters copy the fp32 weights, then the model is cast).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from pipewright.ir import REDUCE_GRAD, Schedule
from pipewright.models.spec import ModelSpec
from pipewright.optim import base_optimizer, global_grad_norm
from pipewright.runtime.core.precision import (
    LossScaler,
    ScaledLoss,
    compute_dtype,
    is_finite,
    reduce_grad_fp32,
)
from pipewright.runtime.core.stage_recompute import apply_recompute
from pipewright.runtime.parallel.moe_parallel import reduce_expert_grads
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tied import TiedEmbeddings
from pipewright.runtime.parallel.zero import MasterOptimizer, reduce_at_step


class TrainingOptions:
    """Applies ``config``'s recompute / precision / tie / init-from options to this rank's ``stages``
    (in place) and builds the matching optimizer. Collective (tied-embedding groups, checkpoint reads
    are per rank)."""

    def __init__(
        self, config, spec: ModelSpec, mesh: ParallelMesh, schedule: Schedule, stages: Mapping[int, nn.Module]
    ) -> None:
        self.config, self.mesh = config, mesh
        self.dtype = compute_dtype(config.precision)
        self.keys_read: list[str] = []
        if config.init_from:
            from pipewright.models.hf_load import load_hf_stage_

            for module in stages.values():
                self.keys_read += load_hf_stage_(module, config.init_from, spec)
        self.tied = TiedEmbeddings(schedule, mesh, stages) if spec.tied_embeddings else None
        for module in stages.values():
            apply_recompute(module, config.recompute)
        self.stages = stages
        self.scaler = LossScaler() if self.dtype == torch.float16 else None
        self.master: MasterOptimizer | None = None

    @property
    def plain(self) -> bool:
        """True when nothing changes the trainer's fp32 optimizer path."""
        return self.dtype == torch.float32 and not self.config.shard_optimizer

    def build_optimizer(self, params: Mapping[str, nn.Parameter]) -> MasterOptimizer:
        """The optimizer over fp32 masters of ``params`` (this rank's parameters, still fp32), then
        the stages cast to the compute dtype."""
        c, mesh = self.config, self.mesh
        self.master = MasterOptimizer(
            params,
            base_optimizer(c.optimizer),
            lr=c.lr,
            weight_decay=c.weight_decay,
            shard=c.shard_optimizer,
            dp_group=mesh.grad_group,  # dp × cp with context parallelism: one reduce-scatter for both
            coords=mesh.coords,
            dp=mesh.dp,
            cp=(mesh.cp_rank, mesh.grad_replicas // mesh.dp),
            separate_masters=self.dtype != torch.float32,
        )
        if self.dtype != torch.float32:
            for module in self.stages.values():
                module.to(self.dtype)
        return self.master

    def loss_fn(self, base: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return ScaledLoss(base, self.scaler) if self.scaler is not None else base

    @property
    def sharded(self) -> bool:
        """ZeRO-1 over dp > 1: the gradients are reduce-scattered after the backward, not all-reduced."""
        return self.config.shard_optimizer and self.mesh.dp > 1

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype the sharded reduction sums in (None: the gradients' own)."""
        return torch.float32 if self.config.reduce_fp32 else None

    @property
    def reduces_over_cp(self) -> bool:
        """The REDUCE_GRAD reduction averages over dp × cp at once (``ParallelMesh.grad_group``): the
        executor's own (also summed in fp32), ZeRO-1's reduce-scatter (sharded over dp × cp) and the
        experts' (dense over dp × cp, experts over expert-dp × cp)."""
        return self.mesh.grad_replicas > self.mesh.dp

    def handlers(self) -> dict:
        if self.sharded:  # reduced in the optimizer's slice layout (runtime/parallel/zero.py)
            return {REDUCE_GRAD: reduce_at_step}
        if self.config.ep > 1:  # experts' gradients over their own group
            return {REDUCE_GRAD: reduce_expert_grads}
        if self.dtype != torch.float32 and self.config.reduce_fp32:
            return {REDUCE_GRAD: reduce_grad_fp32}
        return {}

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def after_backward(self) -> None:
        """Sum the tied embedding's gradients over its two copies; sharded, reduce-scatter the
        gradients over dp (the last gradient collective before the step)."""
        if self.tied is not None:
            self.tied.sync_grads()
        if self.sharded and self.master is not None:
            self.master.reduce_grads(self.reduce_dtype, self.config.collective_timeout_s)

    def norm_params(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less the tied output-layer copy (the table is counted once in the global norm)."""
        skip = self.tied.excluded_from_norm() if self.tied is not None else set()
        return [p for p in params if id(p) not in skip]

    def step(self, norm_params: Sequence[nn.Parameter], groups: Sequence[object], max_norm: float) -> float:
        """Unscale (fp16), clip to the global norm, step the fp32 masters; returns the unscaled norm
        before clipping. An inf/NaN norm under fp16 skips the step and lowers the loss scale."""
        scale = self.loss_scale
        if self.sharded:  # from the reduced slices, all-reduced over dp
            norm = float(self.master.grad_norm(norm_params, groups)) / scale
        else:
            norm = float(global_grad_norm(norm_params, groups)) / scale
        if self.scaler is not None:
            finite = is_finite(norm)
            self.scaler.update(finite)
            if not finite:
                return norm
        factor = 1.0 / scale
        if max_norm > 0 and norm > max_norm:
            factor *= max_norm / (norm + 1e-6)
        self.master.step(factor)
        return norm
