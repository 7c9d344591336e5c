"""Running schedules on torch.distributed: process mesh, launching, point-to-point transfers, split
backward and the pipeline executor. The names below are the public ones (a feature's training plugin
imports its protocol from here); the subpackages group the rest by concern: ``core``, ``setup``,
``checkpointing``, ``reliability``, ``profiling``, ``parallel`` (docs/architecture.md).

They are loaded on first use (PEP 562), so that importing a torch-free submodule such as
:mod:`pipewright.runtime.setup.config` (which ``pipewright train``'s flags are generated from) does not
import torch for every command."""

from __future__ import annotations

from pipewright.lazy import lazy_attributes

#: public name → the submodule that defines it
_WHERE = {
    "DeferrableLinear": "pipewright.models.wgrad",
    "WeightGradStore": "pipewright.models.wgrad",
    "defer_weight_grads": "pipewright.models.wgrad",
    "BuildContext": "pipewright.runtime.core.plugin",
    "Built": "pipewright.runtime.core.plugin",
    "ExecutorParts": "pipewright.runtime.core.plugin",
    "OptimizerContext": "pipewright.runtime.core.plugin",
    "TrainingPlugin": "pipewright.runtime.core.plugin",
    "TrainConfig": "pipewright.runtime.setup.config",
    "ActionError": "pipewright.runtime.core.distributed_errors",
    "DistributedError": "pipewright.runtime.core.distributed_errors",
    "LayoutError": "pipewright.runtime.core.distributed_errors",
    "RecvTimeout": "pipewright.runtime.core.distributed_errors",
    "WorkerError": "pipewright.runtime.core.distributed_errors",
    "PipelineExecutor": "pipewright.runtime.core.executor",
    "RunState": "pipewright.runtime.core.executor",
    "default_handlers": "pipewright.runtime.core.executor",
    "finish_reduction": "pipewright.runtime.core.executor",
    "init_from_env": "pipewright.runtime.setup.launch",
    "running_under_torchrun": "pipewright.runtime.setup.launch",
    "spawn": "pipewright.runtime.setup.launch",
    "ParallelMesh": "pipewright.runtime.parallel.process_mesh",
    "coords_to_rank": "pipewright.runtime.parallel.process_mesh",
    "rank_to_coords": "pipewright.runtime.parallel.process_mesh",
    "gather_timeline": "pipewright.runtime.profiling.measured_timeline",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
