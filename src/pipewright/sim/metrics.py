"""Metrics of a simulated iteration: time, bubble, achieved FLOP/s, MFU and memory per rank.

- ``bubble_fraction`` = Σ_r (T − busy_r) / (p·T), idle over total, T the (steady-state) iteration time.
- ``tflops_per_device`` = FLOPs executed per iteration, recomputation included, / T / devices / 10¹²
  (Megatron-LM's convention, SC21 §5.1).
- ``mfu`` = model FLOPs per iteration (no recomputation) / T / devices / peak FLOP/s
  (PaLM's model FLOPs utilization, Chowdhery et al. 2022).

``devices`` = pipeline ranks × ``num_devices_per_rank``: the number of devices over which a cost model's
per-action ``flops`` are spread — 1 when the cost model reports one device's share (TransformerCost
does), t when it counts the whole tensor-parallel group's work.
"""

from __future__ import annotations

from pipewright.errors import PipewrightError
from pipewright.sim.engine import SimResult


class MemoryLimitError(PipewrightError):
    """A layout needs more memory on some rank than the device has."""


def metrics(
    result: SimResult,
    *,
    num_devices_per_rank: int = 1,
    peak_flops: float | None = None,
    memory_limit: float | None = None,
    enforce: bool = False,
) -> dict:
    """The report of one simulation as a JSON-ready dict.

    ``peak_flops``: one device's peak FLOP/s (``mfu`` is None without it). ``memory_limit``: bytes per
    device; ranks whose ``peak_memory_bytes`` exceed it are listed under ``memory.over_limit`` and
    ``memory.fits`` is False — with ``enforce=True`` that raises :class:`MemoryLimitError` instead.
    """
    time = result.iteration_time
    devices = result.num_ranks * num_devices_per_rank
    per_rank = [
        {
            "rank": r,
            "busy_s": result.busy[r],
            "bubble_s": result.bubble[r],
            "bubble_fraction": result.bubble[r] / time if time > 0 else 0.0,
            "peak_memory_bytes": result.peak_memory[r],
        }
        for r in range(result.num_ranks)
    ]
    over = [] if memory_limit is None else [r for r in per_rank if r["peak_memory_bytes"] > memory_limit]
    if over and enforce:
        worst = max(over, key=lambda r: r["peak_memory_bytes"])
        raise MemoryLimitError(
            f"{result.source.name}: rank {worst['rank']} needs "
            f"{worst['peak_memory_bytes'] / 2**30:.1f} GiB "
            f"but a device has {memory_limit / 2**30:.1f} GiB ({len(over)} of {result.num_ranks} ranks do "
            "not fit); use more pipeline or tensor parallelism, recomputation or a smaller microbatch"
        )
    tflops = result.flops / time / devices / 1e12 if time > 0 else 0.0
    mfu = result.model_flops / time / devices / peak_flops if time > 0 and peak_flops else None
    return {
        "schedule": result.source.name,
        "iterations": result.iterations,
        "step_barrier": result.step_barrier,
        "iteration_time_s": time,
        "bubble_fraction": result.bubble_fraction,
        "tflops_per_device": tflops,
        "mfu": mfu,
        "flops_per_iteration": result.flops,
        "model_flops_per_iteration": result.model_flops,
        "devices": devices,
        "memory": {
            "limit_bytes": memory_limit,
            "fits": not over,
            "over_limit": [r["rank"] for r in over],
            "peak_bytes": max(result.peak_memory, default=0.0),
        },
        "per_rank": per_rank,
    }
