"""The discrete-event simulator and the metrics computed from its (or the runtime's) timelines."""

from pipewright.sim.engine import SimResult, SimulationError, simulate
from pipewright.sim.metrics import MemoryLimitError, metrics

__all__ = ["MemoryLimitError", "SharedCompute", "SimResult", "SimulationError", "metrics", "simulate"]


def __getattr__(name: str):
    """``SharedCompute`` imported on first use (a plain simulation does not need processor sharing)."""
    if name == "SharedCompute":
        from pipewright.sim.sharing import SharedCompute

        return SharedCompute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
