"""The topology graph: devices, switches and bonded links; point-to-point and collective times
(formulas in the :mod:`pipewright.topology` docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pipewright.errors import PipewrightError
from pipewright.hardware import Accelerator, accelerator
from pipewright.topology import nccl, routes, schema
from pipewright.topology.elements import Edge, Node
from pipewright.topology.routes import PathInfo

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
#: GPU kinds older than Ampere (NCCL's ring plateau factor is 1.9 there, 1.4 from Ampere on)
PRE_AMPERE = frozenset({"v100"})


class Topology:
    """A device graph. Devices are addressed by name or by index in :attr:`devices` (the rank order)."""

    def __init__(
        self,
        nodes: Iterable[Node],
        edges: Iterable[Edge],
        name: str = "topology",
        collectives: str = "alpha-beta",
    ) -> None:
        self.name = name
        if collectives not in COLLECTIVE_MODELS:
            known = ", ".join(COLLECTIVE_MODELS)
            raise PipewrightError(
                f"topology {name}: collectives must be one of {known} (got {collectives!r})"
            )
        #: how collectives are priced: a name in :data:`COLLECTIVE_MODELS`
        self.collectives = collectives
        self.nodes: dict[str, Node] = {}
        for n in nodes:
            if n.name in self.nodes:
                raise PipewrightError(f"topology {name}: node {n.name!r} is listed twice")
            self.nodes[n.name] = n
        self.edges: tuple[Edge, ...] = tuple(edges)
        self.devices: tuple[str, ...] = tuple(n.name for n in self.nodes.values() if n.is_device)
        bonded: dict[str, dict[str, tuple[float, float]]] = {n: {} for n in self.nodes}
        for e in self.edges:
            for u in (e.a, e.b):
                if u not in self.nodes:
                    raise PipewrightError(f"topology {name}: link {e.a}–{e.b} names unknown node {u!r}")
            if e.a == e.b:
                raise PipewrightError(f"topology {name}: link from {e.a!r} to itself")
            if e.bandwidth <= 0 or e.latency < 0:
                raise PipewrightError(
                    f"topology {name}: link {e.a}–{e.b} needs bandwidth > 0 and latency ≥ 0"
                )
            bw, lat = bonded[e.a].get(e.b, (0.0, math.inf))
            bonded[e.a][e.b] = bonded[e.b][e.a] = (bw + e.bandwidth, min(lat, e.latency))
        self._adj = bonded
        self._paths: dict[tuple[str, str], PathInfo | None] = {}
        self._rings: dict[tuple[str, ...], tuple[float, float]] = {}
        self._boundary: dict[str, float] | None = None
        self._offhost: dict[str, float] = {}
        self._nvlink = frozenset(u for e in self.edges if e.kind.startswith("nvlink") for u in (e.a, e.b))

    # -- lookup -----------------------------------------------------------------------------------
    def device(self, d: str | int) -> str:
        """The device's name, given a name or an index into :attr:`devices`."""
        if isinstance(d, int):
            if not 0 <= d < len(self.devices):
                raise PipewrightError(
                    f"topology {self.name} has {len(self.devices)} devices; there is no device {d}"
                )
            return self.devices[d]
        node = self.nodes.get(d)
        if node is None or not node.is_device:
            raise PipewrightError(f"topology {self.name} has no device {d!r}")
        return d

    def neighbours(self, node: str) -> Mapping[str, tuple[float, float]]:
        """The nodes one link away from ``node`` (devices and switches), each with the link's
        (bandwidth in bytes/s, latency in s); parallel links between the same two nodes are bonded
        (bandwidths summed, the lowest latency). Read-only; one-line error for an unknown node."""
        links = self._adj.get(node)
        if links is None:
            raise PipewrightError(f"topology {self.name} has no node {node!r}")
        return MappingProxyType(links)

    def accelerator(self, d: str | int) -> Accelerator:
        return accelerator(self.nodes[self.device(d)].accelerator)  # type: ignore[arg-type]

    def host(self, d: str | int) -> str | None:
        return self.nodes[self.device(d)].host

    # -- paths --------------------------------------------------------------------------------------
    def _path(self, a: str, b: str) -> PathInfo | None:
        if a == b:
            return PathInfo(math.inf, 0.0, 0)
        if (a, b) not in self._paths:
            self._paths[a, b] = self._paths[b, a] = routes.best_path(self._adj, a, b)
        return self._paths[a, b]

    def path(self, src: str | int, dst: str | int) -> PathInfo:
        """The best path between two devices; one-line error when they are not connected."""
        a, b = self.device(src), self.device(dst)
        info = self._path(a, b)
        if info is None:
            raise PipewrightError(
                f"device {b!r} is not connected to device {a!r} in topology {self.name}; add a link to it"
            )
        return info

    def p2p_time(self, src: str | int, dst: str | int, nbytes: float) -> float:
        """Σ latency along the best path + ``nbytes`` / its bottleneck bandwidth (0 for src = dst)."""
        return self.path(src, dst).time(nbytes)

    def check_connected(self, devices: Sequence[str | int] | None = None) -> None:
        """One-line error naming the first of ``devices`` (default: all) unreachable from the first."""
        names = [self.device(d) for d in (self.devices if devices is None else devices)]
        for d in names[1:]:
            self.path(names[0], d)

    # -- collectives --------------------------------------------------------------------------------
    def _home(self, name: str) -> str:
        """The node's host, or a host of its own when it has none."""
        host = self.nodes[name].host
        return host if host is not None else f"\0{name}"

    def _egress(self, host: str, members: Sequence[str]) -> float:
        """Bandwidth the group's ``members`` on ``host`` can push off it: the smaller of the bandwidth of
        all links leaving the host and the sum of the members' widest paths to a link leaving it."""
        if self._boundary is None:
            boundary: dict[str, float] = {}
            for u, nbrs in self._adj.items():
                hu = self._home(u)
                for v, (bw, _) in nbrs.items():
                    if self._home(v) != hu:
                        boundary[hu] = boundary.get(hu, 0.0) + bw
            self._boundary = boundary
        return min(self._boundary.get(host, 0.0), sum(self._off_host(m) for m in members))

    def _off_host(self, device: str) -> float:
        """Widest bottleneck from ``device`` to any node off its host (cached per device)."""
        if device not in self._offhost:
            self._offhost[device] = routes.widest_off_host(self._adj, device, self._home)
        return self._offhost[device]

    def ring_bandwidth(self, group: Sequence[str | int]) -> tuple[float, float]:
        """(bus bandwidth B, per-step latency α) of a ring over ``group`` (see the module docstring)."""
        names = tuple(self.device(d) for d in group)
        if names in self._rings:
            return self._rings[names]
        order = {d: i for i, d in enumerate(names)}
        hosts: dict[str, list[str]] = {}
        for d in names:
            hosts.setdefault(self._home(d), []).append(d)
        ring = sorted(names, key=lambda d: (self._home(d), order[d]))
        egress: dict[str, float] = {}
        bandwidth, alpha = math.inf, 0.0
        for u, v in zip(ring, ring[1:] + ring[:1], strict=True):
            if u == v:
                continue
            p = self.path(u, v)
            alpha = max(alpha, p.latency)
            hu, hv = self._home(u), self._home(v)
            if hu == hv:
                bandwidth = min(bandwidth, p.bandwidth)
                continue
            for h in (hu, hv):
                if h not in egress:
                    egress[h] = self._egress(h, hosts[h])
            rings = min(len(hosts[hu]), len(hosts[hv]))
            bandwidth = min(bandwidth, p.bandwidth * rings, egress[hu], egress[hv])
        self._rings[names] = (bandwidth, alpha)
        return bandwidth, alpha

    def collective_time(self, kind: str, group: Sequence[str | int], nbytes: float) -> float:
        """Time of collective ``kind`` over ``group``, ``nbytes`` per device, by the topology's
        collective model (:data:`COLLECTIVE_MODELS`; formulas in the :mod:`pipewright.topology`
        docstring and :mod:`pipewright.topology.nccl`)."""
        if kind not in COLLECTIVES:
            raise PipewrightError(f"unknown collective {kind!r}; choose one of: {', '.join(COLLECTIVES)}")
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        return COLLECTIVE_MODELS[self.collectives](self, kind, group, nbytes)

    def _alpha_beta(self, kind: str, group: Sequence[str | int], nbytes: float) -> float:
        """Ring (bandwidth-optimal) or binary tree (latency-optimal), whichever is faster, with the ring's
        bus bandwidth B and per-step latency α (the module docstring's table)."""
        n = len(group)
        bw, alpha = self.ring_bandwidth(group)
        steps = math.ceil(math.log2(n))
        if kind == "all_reduce":
            ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
            return min(ring, 2 * steps * (alpha + nbytes / bw))
        if kind == "broadcast":
            return min(nbytes / bw + (n - 1) * alpha, steps * (alpha + nbytes / bw))
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha

    def nccl_group(self, group: Sequence[str | int]) -> nccl.Group:
        """What NCCL's model sees of ``group``: ranks, hosts, the class of a step inside a host
        ("nvlink" when every device sharing a host with another has an NVLink link, else "pci"; "pci"
        with one device per host, as NCCL), the ring's bus bandwidth, LL128 (one GPU kind, and NVLink
        inside hosts or one device per host) and Ampere or newer."""
        names = [self.device(d) for d in group]
        hosts: dict[str, int] = {}
        for d in names:
            hosts[self._home(d)] = hosts.get(self._home(d), 0) + 1
        shared = [d for d in names if hosts[self._home(d)] > 1]
        intra = "nvlink" if shared and all(d in self._nvlink for d in shared) else "pci"
        kinds = {self.nodes[d].accelerator for d in names}
        ll128 = len(kinds) == 1 and (intra == "nvlink" or not shared)
        return nccl.Group(
            len(names), len(hosts), intra, self.ring_bandwidth(names)[0], ll128, not kinds & PRE_AMPERE
        )

    def _nccl(self, kind: str, group: Sequence[str | int], nbytes: float) -> float:
        return nccl.collective_time(kind, nbytes, self.nccl_group(group))

    # -- JSON ----------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return schema.to_json(self.name, self.nodes.values(), self.edges) | {"collectives": self.collectives}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Topology:
        """Parse the schema in the :mod:`pipewright.topology` docstring; one-line PipewrightError on bad
        input."""
        nodes, edges, name = schema.parse(data)
        collectives = data.get("collectives", "alpha-beta")
        if not isinstance(collectives, str):
            raise PipewrightError('topology "collectives" must be a string: "alpha-beta" or "nccl"')
        return cls(nodes, edges, name, collectives)

    def save(self, path: str | Path) -> None:
        schema.save(self.to_json(), path)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        from pipewright.files import naming

        data = schema.read(path)
        with naming(path, "topology"):
            return cls.from_json(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        sizes = f"{len(self.devices)} devices, {len(self.nodes)} nodes, {len(self.edges)} links"
        return f"Topology({self.name!r}, {sizes})"


#: collective models by name: ``alpha-beta`` (ring or binary tree over the topology's bus bandwidth and
#: path latencies; gloo and any hand-written graph) and ``nccl`` (NCCL 2.18's algorithm and protocol
#: model, :mod:`pipewright.topology.nccl`; the default of the GPU cluster builders)
COLLECTIVE_MODELS: dict[str, Callable[[Topology, str, Sequence[str | int], float], float]] = {
    "alpha-beta": Topology._alpha_beta,
    "nccl": Topology._nccl,
}
