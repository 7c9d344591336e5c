"""This rank's stages of a run's model: the linear layers they are built with (Megatron's tensor-parallel
linears when tp > 1), the loss function, and the per-microbatch shape of the tensor entering a stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn

from pipewright.models.family import build_stage
from pipewright.models.gpt import loss_fn
from pipewright.models.wgrad import linear_factory_for
from pipewright.runtime.parallel.moe_parallel import expert_parallel
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import tp_linear_factory

if TYPE_CHECKING:
    from pipewright.runtime.core.trainer import PreparedRun


@dataclass
class RankStages:
    """The stage modules this pp rank holds (by stage), on the mesh's device, and what runs them."""

    stages: dict[int, nn.Module]
    loss_fn: Callable[..., Any]
    boundary_shape: Any  # (b, s, h) for every stage, or a model of its own's shapes by stage
    sequence_parallel: bool  # tp > 1 and --sequence-parallel: a stage's input holds s/t tokens


def rank_stages(run: PreparedRun, mesh: ParallelMesh) -> RankStages:
    """Build ``run``'s stages of ``mesh.pp_rank`` (only their layers), seeded by the config.

    Tensor entering a stage: [b, s, h], or this tp rank's [b, s/t, h] under sequence parallelism
    (this cp rank's S/cp tokens under context parallelism); a Hugging Face MoE's router-loss sums ride
    beside the sequence. A model of its own (``run.model``) gives its stages, loss and shapes."""
    c, spec, own = run.config, run.spec, run.model
    factory, loss = linear_factory_for(run.schedule), loss_fn
    sequence_parallel = c.sequence_parallel and mesh.tp > 1
    if mesh.tp > 1:  # Megatron's column/row-parallel linears, vocabulary-parallel embedding and loss
        factory = tp_linear_factory(mesh.tp_group, sequence_parallel=sequence_parallel, num_heads=spec.heads)
        loss = factory.cross_entropy
    seq = spec.seq_len // mesh.cp
    seq = seq // mesh.tp if sequence_parallel else seq
    if spec.family == "hf":
        from pipewright.models.hf.router_loss import loss_with_router_aux
        from pipewright.models.hf.support import boundary_rows

        seq += boundary_rows(spec.name)
        loss = loss_with_router_aux(loss)
    boundary_shape: Any = (c.microbatch_size, seq, spec.hidden)
    experts = expert_parallel(mesh)  # MoE layers hold this ep rank's experts (None: all)
    if own is None:
        # only MoE models take the ep argument (a family's builder need not know it)
        build = partial(build_stage, spec, **({} if experts is None else {"expert_parallel": experts}))
    else:
        build = own.build_stage
        loss, boundary_shape = own.loss_fn, own.boundary_shapes(run.layout, c.microbatch_size)
    stages = {
        s: build(run.layout, s, seed=c.seed, linear_factory=factory).to(mesh.device)
        for s in run.schedule.stages_of(mesh.pp_rank)
    }
    if own is not None:
        own.share_tied(stages)  # one object per tied module on this rank
    return RankStages(stages, loss, boundary_shape, sequence_parallel)
