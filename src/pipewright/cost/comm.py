"""The CommModel that prices messages between the devices a :class:`~pipewright.mesh.Mesh` assigns.

The rank order and placement are :mod:`pipewright.mesh`'s (the runtime's too): with the default
``tp-dp-pp``, global rank g = tp_rank + t·(dp_rank + d·pp_rank), and rank g runs on
``topology.devices[mesh.device_index(g)]``. With the node-major device order of
:func:`pipewright.topology.cluster`, a tensor-parallel group of t ≤ GPUs-per-node stays inside one
machine (NVLink) and pipeline neighbours sit t·d devices apart (usually on other machines, over
InfiniBand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipewright.cost.sharding import reduction_time
from pipewright.errors import ConfigError
from pipewright.hardware import accelerator
from pipewright.mesh import Mesh
from pipewright.topology import Topology, cluster, single_host


def check_fits(mesh: Mesh, topology: Topology) -> None:
    """One-line error when the topology has too few devices for ``mesh``."""
    if len(topology.devices) < mesh.size:
        raise ConfigError(
            f"{mesh._sizes()} = {mesh.size} ranks, but topology "
            f"{topology.name} has {len(topology.devices)} devices; add nodes or shrink the layout"
        )


@dataclass(frozen=True, eq=False)
class TopologyComm:
    """:class:`~pipewright.cost.base.CommModel` over a topology: pipeline rank r is the device of global
    rank ``mesh.global_rank(r)`` (its tp-rank-0, dp-replica-0 device — the one simulated pipeline),
    placed by ``mesh.device_index``.

    ``p2p_time`` prices a message by the topology's best path. ``collective_time(kind, rank, nbytes)``
    runs over rank r's data-parallel group (REDUCE_GRAD = an all-reduce over dp) by the topology's
    collective model (:meth:`Topology.collective_time`: NCCL's model on GPU clusters, the α–β ring/tree
    on gloo). An all-reduce whose bytes are a :class:`~pipewright.cost.sharding.Reduction` (a sharded
    optimizer's REDUCE_GRAD) runs its calls one after the other, each priced as its own collective (a
    reduce-scatter, then an all-gather). ``bandwidth_efficiency`` is the fraction of link bandwidth the
    communication library reaches (NCCL's bus bandwidth is ≈ 80 % of NVLink/InfiniBand peak);
    latencies are not scaled.
    """

    topology: Topology
    mesh: Mesh = field(default_factory=Mesh)
    bandwidth_efficiency: float = 1.0
    #: memoised group device lists and collective times (the topology and mesh are immutable)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fits(self.mesh, self.topology)

    def _device(self, global_rank: int) -> str:
        return self.topology.devices[self.mesh.device_index(global_rank)]

    def device_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> str:
        """The topology device that runs coordinates (tp, pp, dp)."""
        return self._device(self.mesh.rank(tp, pp, dp))

    def device(self, rank: int) -> str:
        if not 0 <= rank < self.mesh.pp:
            raise ConfigError(
                f"pipeline rank {rank} is outside the mesh's pp = {self.mesh.pp}; set --pp to the stages"
            )
        return self._device(self.mesh.global_rank(rank))

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst:
            return 0.0
        return self.topology.p2p_time(self.device(src), self.device(dst), nbytes / self.bandwidth_efficiency)

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        """Collective ``kind`` over rank's dp or tp group, or over the devices of pipeline ranks
        ``members`` (groups that span the pipeline); a barrier costs one all-reduce of 1 byte."""
        members = tuple(members)
        if getattr(nbytes, "calls", ()):
            return reduction_time(kind, nbytes, lambda k, b: self.collective_time(k, rank, b, group, members))
        key = (kind, rank, nbytes, group, members)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._collective_time(kind, rank, nbytes, group, members)
        return hit

    def _collective_time(
        self, kind: str, rank: int, nbytes: float, group: str, members: tuple[int, ...]
    ) -> float:
        self.device(rank)
        if group == "dp":
            ranks = self.mesh.grad_group(rank)  # dp × cp replicas of the stage (the dp group at cp 1)
        elif group == "tp":
            ranks = self.mesh.tp_group(rank)
        elif group == "cp":
            ranks = self.mesh.cp_group(rank)
        elif group == "ep":
            ranks = self.mesh.ep_group(self.mesh.global_rank(rank))
        else:
            ranks = tuple(self.mesh.global_rank(m) for m in (members or range(self.mesh.pp)))
        devices = [self._device(g) for g in ranks]
        if kind == "barrier":
            kind, nbytes = "all_reduce", 1.0
        elif kind == "reduce":
            kind = "broadcast"  # a tree reduce moves what a broadcast does, in reverse
        seconds = self.topology.collective_time(kind, devices, nbytes / self.bandwidth_efficiency)
        return max(seconds, collective_floor(self.topology, kind, devices))

    def tp_all_reduce_time(self, rank: int, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` over pipeline rank ``rank``'s tensor-parallel group."""
        return self.collective_time("all_reduce", rank, nbytes, group="tp")


#: ring steps of a collective over n devices, in units of (n − 1)
_RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_to_all": 1}


def collective_floor(topology: Topology, kind: str, devices: list[str]) -> float:
    """The least time of a launched NCCL collective over ``devices``: its ring steps (2(n − 1) for an
    all-reduce, n − 1 otherwise) × the accelerator's measured step latency
    (:attr:`~pipewright.hardware.Accelerator.collective_step_latency`; 0 where none is known)."""
    if len(devices) < 2 or kind not in _RING_STEPS:
        return 0.0
    step = getattr(topology.accelerator(devices[0]), "collective_step_latency", 0.0)
    return _RING_STEPS[kind] * (len(devices) - 1) * step


def default_topology(gpu: str, devices: int) -> Topology:
    """Where no topology is given: 8-GPU NVLink machines on the GPU's usual fabric (one NIC per GPU),
    or, for ``cpu``, processes of this machine on gloo loopback."""
    if gpu == "cpu":
        return single_host(devices)
    per_node = min(devices, 8)
    intra = "nvlink" if accelerator(gpu).nvlink else "pcie4"
    return cluster(math.ceil(devices / per_node), per_node, gpu, intra=intra)
