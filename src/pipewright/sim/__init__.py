"""The discrete-event simulator and the metrics computed from its (or the runtime's) timelines."""

from pipewright.sim.engine import SimResult, SimulationError, simulate
from pipewright.sim.metrics import MemoryLimitError, metrics
from pipewright.sim.sharing import SharedCompute

__all__ = ["MemoryLimitError", "SharedCompute", "SimResult", "SimulationError", "metrics", "simulate"]
