"""Running schedules on torch.distributed: process mesh, launching, point-to-point transfers, split
backward and the pipeline executor.

The names below are loaded on first use (PEP 562), so that importing a torch-free submodule such as
:mod:`pipewright.runtime.config` (which ``pipewright train``'s flags are generated from) does not
import torch for every command."""

from __future__ import annotations

from pipewright.lazy import lazy_attributes

#: public name → the submodule that defines it
_WHERE = {
    "DeferrableLinear": "pipewright.models.wgrad",
    "WeightGradStore": "pipewright.models.wgrad",
    "defer_weight_grads": "pipewright.models.wgrad",
    "ActionError": "pipewright.runtime.errors",
    "DistributedError": "pipewright.runtime.errors",
    "LayoutError": "pipewright.runtime.errors",
    "RecvTimeout": "pipewright.runtime.errors",
    "WorkerError": "pipewright.runtime.errors",
    "PipelineExecutor": "pipewright.runtime.executor",
    "RunState": "pipewright.runtime.executor",
    "default_handlers": "pipewright.runtime.executor",
    "finish_reduction": "pipewright.runtime.executor",
    "init_from_env": "pipewright.runtime.launch",
    "running_under_torchrun": "pipewright.runtime.launch",
    "spawn": "pipewright.runtime.launch",
    "ParallelMesh": "pipewright.runtime.mesh",
    "coords_to_rank": "pipewright.runtime.mesh",
    "rank_to_coords": "pipewright.runtime.mesh",
    "gather_timeline": "pipewright.runtime.timeline",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
