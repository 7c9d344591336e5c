"""The discrete-event simulator and the metrics computed from its (or the runtime's) timelines."""

from pipewright.sim.engine import SimResult, SimulationError, simulate
from pipewright.sim.metrics import MemoryLimitError, metrics

__all__ = ["MemoryLimitError", "SimResult", "SimulationError", "metrics", "simulate"]
