"""What the planner searches: a candidate layout, the problem it plans for, and an evaluated candidate
(its partition, device assignment, closed-form estimate and, for finalists, its simulation)."""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.recompute import RECOMPUTE_CHOICES
from pipewright.cost.transformer import A100_EFFICIENCY, Efficiency
from pipewright.models.spec import ModelSpec
from pipewright.plan.profiled import ProfileInput
from pipewright.topology import Topology

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-auto")


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    tp: int
    pp: int
    dp: int
    microbatch: int
    microbatches: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    style: str = "pp"

    def describe(self) -> str:
        v = f" v={self.virtual}" if self.virtual > 1 else ""
        sp = "+sp" if self.sequence_parallel else ""
        return (
            f"t={self.tp} p={self.pp} d={self.dp} b={self.microbatch} m={self.microbatches} "
            f"{self.schedule}{v} recompute={self.recompute}{sp} map={self.style}"
        )


@dataclass(frozen=True)
class Problem:
    """What to plan: a model on a topology with a global batch."""

    spec: ModelSpec
    topology: Topology
    global_batch: int
    dtype: str = "bf16"
    memory_limit: float | None = None  # bytes per device; None: each device's own memory
    efficiency: Efficiency = A100_EFFICIENCY
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_tp: int = 8
    finalists: int = 6
    fixed: tuple[int | None, int | None, int | None] = (None, None, None)  # (tp, pp, dp) if given
    cores: float | None = None  # all processes share this many CPU cores (sim.sharing), e.g. --gpu cpu
    profile: ProfileInput | None = None  # measured costs instead of the analytical model (plan/profiled.py)


@dataclass
class Evaluated:
    """A candidate with its partition, device assignment, estimate and (for finalists) simulation."""

    candidate: Candidate
    chunk_layers: tuple[int, ...]
    devices: tuple[str, ...]  # global rank order
    estimate: float
    bottleneck: float
    peak_memory: float = 0.0  # estimated bytes on the fullest device
    simulated: float | None = None
    simulated_memory: float | None = None
    fits: bool = True
    label: str = "plan"
    why: str = ""
    schedule: object = None  # a generated Schedule (zb-auto's cost-aware order), else built by name
    zb_memory_limit: int | None = None
    recompute_per_stage: tuple[str, ...] | None = None  # one mode per chunk, when they differ

    @property
    def time(self) -> float:
        return self.simulated if self.simulated is not None else self.estimate
