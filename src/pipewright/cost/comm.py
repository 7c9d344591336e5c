"""Mapping pipeline ranks onto the devices of a topology, and the CommModel that prices their messages.

PTD-P rank order (Megatron-LM's default ``tp-dp-pp``): tensor-parallel rank innermost, then data-parallel,
then pipeline-parallel — global rank g = tp_rank + t·(dp_rank + d·pp_rank), and global rank g runs on
``topology.devices[g]``. With the node-major device order of :func:`pipewright.topology.cluster`, a
tensor-parallel group of t ≤ GPUs-per-node stays inside one machine (NVLink) and pipeline neighbours sit
t·d devices apart (usually on other machines, over InfiniBand).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipewright.errors import ConfigError
from pipewright.topology import Topology


@dataclass(frozen=True)
class Mesh:
    """The parallel layout: ``tp`` × ``pp`` × ``dp`` ranks in PTD-P order (see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1 (got {getattr(self, name)})")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def global_rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def tp_group(self, pp_rank: int, dp_rank: int = 0) -> tuple[int, ...]:
        return tuple(self.global_rank(pp_rank, dp_rank, i) for i in range(self.tp))

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        return tuple(self.global_rank(pp_rank, j, tp_rank) for j in range(self.dp))

    def check(self, topology: Topology) -> None:
        """One-line error when the topology has too few devices for this mesh."""
        if len(topology.devices) < self.size:
            raise ConfigError(
                f"tp {self.tp} × pp {self.pp} × dp {self.dp} = {self.size} ranks, but topology "
                f"{topology.name} has {len(topology.devices)} devices; add nodes or shrink the layout"
            )


@dataclass(frozen=True, eq=False)
class TopologyComm:
    """:class:`~pipewright.cost.base.CommModel` over a topology: pipeline rank r is the device of global
    rank ``mesh.global_rank(r)`` (its tp-rank-0, dp-replica-0 device — the one simulated pipeline).

    ``p2p_time`` prices a message by the topology's best path. ``collective_time(kind, rank, nbytes)``
    runs over rank r's data-parallel group (REDUCE_GRAD = ring all-reduce over dp; see
    :meth:`Topology.collective_time`). ``bandwidth_efficiency`` is the fraction of link bandwidth the
    communication library reaches (NCCL's bus bandwidth is ≈ 80 % of NVLink/InfiniBand peak); latencies
    are not scaled.
    """

    topology: Topology
    mesh: Mesh = field(default_factory=Mesh)
    bandwidth_efficiency: float = 1.0

    def __post_init__(self) -> None:
        self.mesh.check(self.topology)

    def device(self, rank: int) -> str:
        if not 0 <= rank < self.mesh.pp:
            raise ConfigError(
                f"pipeline rank {rank} is outside the mesh's pp = {self.mesh.pp}; set --pp to the stages"
            )
        return self.topology.devices[self.mesh.global_rank(rank)]

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst:
            return 0.0
        return self.topology.p2p_time(self.device(src), self.device(dst), nbytes / self.bandwidth_efficiency)

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        """Collective ``kind`` over rank's dp or tp group, or over the devices of pipeline ranks
        ``members`` (groups that span the pipeline); a barrier costs one all-reduce of 1 byte."""
        self.device(rank)
        if group == "dp":
            ranks = self.mesh.dp_group(rank)
        elif group == "tp":
            ranks = self.mesh.tp_group(rank)
        else:
            ranks = tuple(self.mesh.global_rank(m) for m in (members or range(self.mesh.pp)))
        devices = [self.topology.devices[g] for g in ranks]
        if kind == "barrier":
            kind, nbytes = "all_reduce", 1.0
        elif kind == "reduce":
            kind = "broadcast"  # a tree reduce moves what a broadcast does, in reverse
        return self.topology.collective_time(kind, devices, nbytes / self.bandwidth_efficiency)

    def tp_all_reduce_time(self, rank: int, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` over pipeline rank ``rank``'s tensor-parallel group."""
        self.device(rank)
        group = [self.topology.devices[g] for g in self.mesh.tp_group(rank)]
        return self.topology.collective_time("all_reduce", group, nbytes / self.bandwidth_efficiency)
