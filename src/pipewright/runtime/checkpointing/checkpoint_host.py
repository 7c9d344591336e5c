"""A checkpoint's host-side parts: the random generators' states it keeps, and the group its barriers
run on (:mod:`pipewright.runtime.checkpointing.checkpoint`).

RNG states are kept per rank: the CPU generator's under ``rng/rank{r}`` and, where CUDA is present,
the current CUDA device's under ``rng/rank{r}/cuda`` (dropout and any sampling on the GPU resume where
they were). Each is restored when the checkpoint holds it: older checkpoints (no CUDA state) and
checkpoints written on GPUs but resumed on CPUs load as before.

Barriers and the broadcast of rank 0's errors run on a gloo group over every rank
(:func:`host_group`): on a NCCL run a barrier on the default group would be a NCCL collective on the
device — it orders streams rather than the host, and one that never completes is NCCL's watchdog's to
abort rather than the run guard's to report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pipewright.runtime.reliability.timeouts import new_group


def rng_sources() -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]]:
    """Key suffix → (get, set) of each random generator a checkpoint keeps: the CPU's and, where CUDA
    is present, the current CUDA device's."""
    sources = {"": (torch.get_rng_state, torch.set_rng_state)}
    device = _device_rng()
    if device is not None:
        sources["/cuda"] = device
    return sources


def _device_rng() -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]] | None:
    """(get, set) of the current CUDA device's generator; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_rng_state, torch.cuda.set_rng_state


#: the gloo group over every rank of each NCCL default group (:func:`host_group`)
_HOST_GROUPS: dict[int, dist.ProcessGroup] = {}


def host_group() -> dist.ProcessGroup | None:
    """A gloo group over every rank for the checkpoint's host-side synchronisation (module docstring):
    the default group itself when it is gloo (None), else one created at the first call — collective,
    as every save and load is."""
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = new_group(list(range(dist.get_world_size())), backend="gloo")
    return _HOST_GROUPS[key]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=host_group())
