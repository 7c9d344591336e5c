"""Running schedules on torch.distributed: process mesh, launching, point-to-point transfers, split
backward and the pipeline executor."""

from pipewright.models.wgrad import DeferrableLinear, WeightGradStore, defer_weight_grads
from pipewright.runtime.errors import ActionError, DistributedError, LayoutError, RecvTimeout, WorkerError
from pipewright.runtime.executor import PipelineExecutor, RunState, default_handlers, finish_reduction
from pipewright.runtime.launch import init_from_env, running_under_torchrun, spawn
from pipewright.runtime.mesh import ParallelMesh, coords_to_rank, rank_to_coords
from pipewright.runtime.timeline import gather_timeline

__all__ = [
    "ActionError",
    "DeferrableLinear",
    "DistributedError",
    "LayoutError",
    "ParallelMesh",
    "PipelineExecutor",
    "RecvTimeout",
    "RunState",
    "WeightGradStore",
    "WorkerError",
    "coords_to_rank",
    "default_handlers",
    "defer_weight_grads",
    "finish_reduction",
    "gather_timeline",
    "init_from_env",
    "rank_to_coords",
    "running_under_torchrun",
    "spawn",
]
