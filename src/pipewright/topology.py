"""Cluster topology: an arbitrary graph of devices, switches and links, and the time to move bytes.

Nodes are devices (with an accelerator kind from :mod:`pipewright.hardware` and a host id) or switches
(NVSwitch, PCIe switch, NIC, InfiniBand leaf/spine; a switch may belong to a host or to the fabric).
Links are undirected, full duplex, with a per-direction ``bandwidth`` (bytes/s) and a ``latency`` (s).
Several links between one pair are *bonded*: their bandwidths add and the smallest latency counts.

**Point to point.** The best path between two devices is the widest one (largest bottleneck bandwidth),
then the one with fewest hops, then the one with least latency. Time = Σ latency along it + bytes /
bottleneck bandwidth. Paths are searched per pair on first use and cached in the instance.

**Collectives** over a group of n devices, ``nbytes`` per device, bus bandwidth B and per-step
latency α (the largest path latency between ring neighbours), the devices ordered by host then as given:

=================  =====================================  ==============================
collective         ring (bandwidth-optimal)               binary tree (latency-optimal)
=================  =====================================  ==============================
all_reduce         2(n−1)/n · bytes/B + 2(n−1)·α          2⌈log₂n⌉ · (α + bytes/B)
all_gather         (n−1)/n · bytes/B + (n−1)·α            —
reduce_scatter     (n−1)/n · bytes/B + (n−1)·α            —
broadcast          bytes/B + (n−1)·α (pipelined chain)    ⌈log₂n⌉ · (α + bytes/B)
=================  =====================================  ==============================

The smaller of the two is taken (NCCL likewise switches to trees for small messages). B is the
smallest, over ring neighbours, of: the pair's path bandwidth when both sit on one host; and, for a pair
on two hosts, the pair's path bandwidth times the number of parallel rings (the fewer group members on
either host — NCCL runs one ring per NIC), capped by either host's egress (the smaller of the bandwidth
of all links leaving the host and the members' own widest paths off it). Oversubscription inside the
fabric beyond that is seen only through the pair bandwidth.

**JSON schema** (``Topology.to_json`` / ``Topology.from_json``, ``save`` / ``load``)::

    {"format": "pipewright-topology", "version": 1, "name": "selene-4x8",
     "nodes": [{"name": "node0/gpu0", "type": "device", "accelerator": "a100-80gb", "host": "node0"},
               {"name": "fabric", "type": "switch", "host": null}],
     "links": [{"a": "node0/gpu0", "b": "fabric", "kind": "ib-hdr",
                "bandwidth": 25e9, "latency": 2.5e-6}]}

``type`` is "device" or "switch"; ``accelerator`` is required for devices; ``host`` is optional (a
string; ``null`` for fabric switches). In links, ``bandwidth`` and ``latency`` are optional and default
to the catalogue values of ``kind`` (a :func:`pipewright.hardware.link` name; any string when both are
given). Devices are numbered in the order they are listed: that order is the rank order.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pipewright.errors import PipewrightError
from pipewright.hardware import Accelerator, accelerator, link

FORMAT = "pipewright-topology"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class Node:
    """A device (``accelerator`` set) or a switch (``accelerator`` None). ``host`` groups nodes of one
    machine; fabric switches have none."""

    name: str
    accelerator: str | None = None
    host: str | None = None

    @property
    def is_device(self) -> bool:
        return self.accelerator is not None


@dataclass(frozen=True)
class Edge:
    """An undirected link between nodes ``a`` and ``b``."""

    a: str
    b: str
    kind: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class PathInfo:
    """The best path between two nodes: bottleneck ``bandwidth``, total ``latency``, ``hops``."""

    bandwidth: float
    latency: float
    hops: int

    def time(self, nbytes: float) -> float:
        if self.hops == 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


class Topology:
    """A device graph. Devices are addressed by name or by index in :attr:`devices` (the rank order)."""

    def __init__(self, nodes: Iterable[Node], edges: Iterable[Edge], name: str = "topology") -> None:
        self.name = name
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
    def _search(self, src: str, dst: str) -> PathInfo | None:
        """Best path ``src`` → ``dst``: the widest bottleneck W first (widest-path Dijkstra), then fewest
        hops and least latency over links of bandwidth ≥ W. Both searches look at ``dst`` first when
        expanding a node and prune what cannot beat the best ``dst`` label found, so a search through a
        big switch does not push all of its ports."""
        adj = self._adj
        width = {src: math.inf}
        heap: list[tuple[float, str]] = [(-math.inf, src)]
        done: set[str] = set()
        found = 0.0
        while heap:
            neg, u = heapq.heappop(heap)
            if u in done or -neg <= found:
                continue
            done.add(u)
            if u == dst:
                break
            direct = adj[u].get(dst)
            if direct is not None:
                found = max(found, min(-neg, direct[0]))
                if found == -neg:
                    break  # nothing left in the heap is wider than u
            for v, (bw, _) in adj[u].items():
                w = min(-neg, bw)
                if w > found and v not in done and w > width.get(v, 0.0):
                    width[v] = w
                    heapq.heappush(heap, (-w, v))
        threshold = max(found, width.get(dst, 0.0) if dst in done else 0.0)
        if threshold == 0.0:
            return None
        best = {src: (0, 0.0)}
        queue: list[tuple[int, float, str]] = [(0, 0.0, src)]
        while queue:
            hops, lat, u = heapq.heappop(queue)
            if u == dst:
                return PathInfo(threshold, lat, hops)
            if (hops, lat) > best[u]:
                continue
            direct = adj[u].get(dst)
            candidate = (hops + 1, lat + direct[1]) if direct is not None and direct[0] >= threshold else None
            if candidate is not None and candidate < best.get(dst, (math.inf, math.inf)):
                best[dst] = candidate
                heapq.heappush(queue, (*candidate, dst))
            limit = best.get(dst, (math.inf, math.inf))[0]
            for v, (bw, l) in adj[u].items():
                if (
                    bw >= threshold
                    and hops + 1 < limit
                    and (hops + 1, lat + l) < best.get(v, (math.inf, math.inf))
                ):
                    best[v] = (hops + 1, lat + l)
                    heapq.heappush(queue, (hops + 1, lat + l, v))
        raise AssertionError("a path of width W exists")  # pragma: no cover

    def _path(self, a: str, b: str) -> PathInfo | None:
        if a == b:
            return PathInfo(math.inf, 0.0, 0)
        if (a, b) not in self._paths:
            self._paths[a, b] = self._paths[b, a] = self._search(a, b)
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
        """Widest bottleneck from ``device`` to any node off its host, searching inside the host only."""
        if device in self._offhost:
            return self._offhost[device]
        host = self._home(device)
        width = {device: math.inf}
        heap: list[tuple[float, str]] = [(-math.inf, device)]
        best = 0.0
        while heap:
            neg, u = heapq.heappop(heap)
            if -neg < width[u]:
                continue
            for v, (bw, _) in self._adj[u].items():
                w = min(-neg, bw)
                if self._home(v) != host:
                    best = max(best, w)
                elif w > width.get(v, 0.0):
                    width[v] = w
                    heapq.heappush(heap, (-w, v))
        self._offhost[device] = best
        return best

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
        """Time of collective ``kind`` over ``group``, ``nbytes`` per device (formulas: module docstring)."""
        n = len(group)
        if kind not in COLLECTIVES:
            raise PipewrightError(f"unknown collective {kind!r}; choose one of: {', '.join(COLLECTIVES)}")
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, alpha = self.ring_bandwidth(group)
        steps = math.ceil(math.log2(n))
        if kind == "all_reduce":
            ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
            return min(ring, 2 * steps * (alpha + nbytes / bw))
        if kind == "broadcast":
            return min(nbytes / bw + (n - 1) * alpha, steps * (alpha + nbytes / bw))
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha

    # -- JSON ----------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "name": self.name,
            "nodes": [
                {"name": n.name, "type": "device" if n.is_device else "switch", "host": n.host}
                | ({"accelerator": n.accelerator} if n.is_device else {})
                for n in self.nodes.values()
            ],
            "links": [
                {"a": e.a, "b": e.b, "kind": e.kind, "bandwidth": e.bandwidth, "latency": e.latency}
                for e in self.edges
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Topology:
        """Parse the schema in the module docstring; one-line PipewrightError on bad input."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise PipewrightError(f'not a topology file: expected "format": "{FORMAT}"')
        name = data.get("name", "topology")
        if not isinstance(name, str):
            raise PipewrightError('topology "name" must be a string')
        nodes = []
        for i, item in enumerate(_list(data, "nodes")):
            _strings(item, f"topology node {i}", ("name", "type", "accelerator", "host"))
            kind = item.get("type", "device")
            acc = item.get("accelerator")
            if kind not in ("device", "switch") or "name" not in item:
                raise PipewrightError(f'topology node {i}: needs a name and type "device" or "switch"')
            if kind == "device":
                if acc is None:
                    raise PipewrightError(f"topology device {item['name']!r} needs an accelerator")
                accelerator(str(acc))  # one-line error on an unknown kind
            host = item.get("host")
            nodes.append(
                Node(
                    str(item["name"]),
                    str(acc) if kind == "device" else None,
                    None if host is None else str(host),
                )
            )
        edges = []
        for i, item in enumerate(_list(data, "links")):
            _strings(item, f"topology link {i}", ("a", "b", "kind"))
            try:
                a, b, kind = str(item["a"]), str(item["b"]), str(item["kind"])
            except (KeyError, TypeError):
                raise PipewrightError(f'topology link {i}: needs "a", "b" and "kind"') from None
            if "bandwidth" in item and "latency" in item:
                bw, lat = item["bandwidth"], item["latency"]
            else:
                spec = link(kind)
                bw, lat = item.get("bandwidth", spec.bandwidth), item.get("latency", spec.latency)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (bw, lat)):
                raise PipewrightError(f"topology link {i}: bandwidth and latency must be numbers")
            if not (0 < bw < 1e300 and 0 <= lat < 1e300):  # also NaN, inf and ints past float
                raise PipewrightError(
                    f"topology link {i}: bandwidth must be positive and latency 0 or more, both finite"
                )
            edges.append(Edge(a, b, kind, float(bw), float(lat)))
        return cls(nodes, edges, name)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            from pipewright.files import read_text

            data = json.loads(read_text(path, "topology"))  # one line for a non-UTF-8 file too
        except OSError as exc:
            raise PipewrightError(f"cannot read topology {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise PipewrightError(
                f"topology {path} is not valid JSON: {exc.msg} (line {exc.lineno})"
            ) from None
        return cls.from_json(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        sizes = f"{len(self.devices)} devices, {len(self.nodes)} nodes, {len(self.edges)} links"
        return f"Topology({self.name!r}, {sizes})"


def _strings(item: Mapping[str, Any], where: str, keys: Sequence[str]) -> None:
    """Each of ``keys`` present in ``item`` is a string (``host`` may be null)."""
    for key in keys:
        value = item.get(key)
        if value is not None and not isinstance(value, str):
            raise PipewrightError(f'{where}: "{key}" must be a string, not {type(value).__name__}')


def _list(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(x, Mapping) for x in items):
        raise PipewrightError(f'topology "{key}" must be a list of objects')
    return items


# -- builders ----------------------------------------------------------------------------------------


def _link_edge(a: str, b: str, kind: str, via_switch: bool = True, count: int = 1) -> Edge:
    """An edge of link ``kind``; a device–switch edge carries half the link latency so that
    device → switch → device costs the catalogue latency once."""
    spec = link(kind)
    return Edge(a, b, spec.name, spec.bandwidth * count, spec.latency / 2 if via_switch else spec.latency)


def _intra_kind(gpu: str, intra: str) -> str:
    if intra != "nvlink":
        return link(intra).name
    nv = accelerator(gpu).nvlink
    if nv is None:
        raise PipewrightError(f'{gpu} has no NVLink; pass intra="pcie4" (or another link kind)')
    return nv


def _add_host(
    nodes: list[Node],
    edges: list[Edge],
    host: str,
    gpus: int,
    gpu: str,
    intra: str,
    inter: str | None,
    fabric: str | None,
    nics: int,
) -> None:
    """One machine: ``gpus`` devices on an intra-host switch; ``nics`` NICs to ``fabric`` (each GPU its
    own NIC when nics = gpus, as the 8 HDR ports of a DGX A100; otherwise GPUs share NICs over PCIe)."""
    if gpus < 1 or nics < 1:
        raise PipewrightError("gpus per node and NICs per node must be at least 1")
    switch = f"{host}/switch"
    nodes.append(Node(switch, None, host))
    kind = _intra_kind(gpu, intra)
    names = [f"{host}/gpu{j}" for j in range(gpus)]
    for name in names:
        nodes.append(Node(name, gpu, host))
        edges.append(_link_edge(name, switch, kind))
    if fabric is None or inter is None:
        return
    if nics == gpus:
        edges.extend(_link_edge(name, fabric, inter) for name in names)
        return
    for k in range(nics):
        nic = f"{host}/nic{k}"
        nodes.append(Node(nic, None, host))
        edges.append(_link_edge(nic, fabric, inter))
        for j in range(gpus):
            if j * nics // gpus == k:
                edges.append(_link_edge(names[j], nic, "pcie4"))


def cluster(
    nodes: int,
    gpus_per_node: int,
    gpu: str = "a100-80gb",
    intra: str = "nvlink",
    inter: str = "ib-hdr",
    nics_per_node: int | None = None,
) -> Topology:
    """``nodes`` machines of ``gpus_per_node`` GPUs: an NVSwitch-style switch inside each machine (link
    ``intra``; "nvlink" = the GPU's NVLink generation) and one non-blocking fabric switch between them
    (link ``inter``), reached through ``nics_per_node`` NICs (default: one per GPU, as Selene's 8×HDR
    per DGX A100). Devices are named ``node{i}/gpu{j}``, rank order node-major."""
    if nodes < 1:
        raise PipewrightError(f"--nodes must be at least 1 (got {nodes})")
    out_nodes: list[Node] = []
    edges: list[Edge] = []
    fabric = "fabric" if nodes > 1 else None
    if fabric:
        out_nodes.append(Node(fabric))
    for i in range(nodes):
        _add_host(
            out_nodes, edges, f"node{i}", gpus_per_node, gpu, intra, inter, fabric,
            nics_per_node or gpus_per_node,
        )  # fmt: skip
    return Topology(out_nodes, edges, f"{nodes}x{gpus_per_node}-{gpu}")


def ring(n: int, gpu: str = "a100-80gb", kind: str = "nvlink3", host: str | None = "host0") -> Topology:
    """``n`` devices ``d0 … d{n-1}`` in a ring, each linked directly to the next by ``kind``; all on one
    ``host`` (``None``: each device its own host)."""
    if n < 1:
        raise PipewrightError(f"a ring needs at least 1 device (got {n})")
    nodes = [Node(f"d{i}", gpu, host if host is not None else f"h{i}") for i in range(n)]
    pairs = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)] if n == 2 else []
    edges = [_link_edge(f"d{a}", f"d{b}", kind, via_switch=False) for a, b in pairs]
    return Topology(nodes, edges, f"ring{n}-{gpu}")


def single_host(n: int, gpu: str = "cpu", kind: str = "gloo-loopback") -> Topology:
    """This machine: ``n`` single-threaded CPU processes talking gloo over loopback (≈ 0.2 ms, 1.8 GB/s)."""
    nodes = [Node("loopback", None, "host0")] + [Node(f"cpu{i}", gpu, "host0") for i in range(n)]
    edges = [_link_edge(f"cpu{i}", "loopback", kind) for i in range(n)]
    return Topology(nodes, edges, f"local-{n}x{gpu}")


def two_tier(
    leaves: int,
    nodes_per_leaf: int,
    gpus_per_node: int,
    gpu: str = "a100-80gb",
    spines: int = 2,
    intra: str = "nvlink",
    inter: str = "ib-hdr",
    uplink: str | None = None,
    uplinks_per_spine: int = 1,
    nics_per_node: int | None = None,
) -> Topology:
    """Leaf/spine fabric: each leaf switch serves ``nodes_per_leaf`` machines (NICs as in :func:`cluster`)
    and connects to each of ``spines`` spine switches with ``uplinks_per_spine`` bonded ``uplink`` links
    (default: ``inter``). Fewer uplinks than NICs per leaf make the fabric oversubscribed."""
    nodes: list[Node] = [Node(f"spine{k}") for k in range(spines)]
    edges: list[Edge] = []
    for lf in range(leaves):
        leaf = f"leaf{lf}"
        nodes.append(Node(leaf))
        for k in range(spines):
            edges.append(
                _link_edge(leaf, f"spine{k}", uplink or inter, via_switch=False, count=uplinks_per_spine)
            )
        for i in range(nodes_per_leaf):
            host = f"node{lf * nodes_per_leaf + i}"
            _add_host(
                nodes, edges, host, gpus_per_node, gpu, intra, inter, leaf, nics_per_node or gpus_per_node
            )
    return Topology(nodes, edges, f"two-tier-{leaves}x{nodes_per_leaf}x{gpus_per_node}-{gpu}")


def heterogeneous(
    groups: Sequence[tuple[int, int, str]],
    intra: str = "nvlink",
    inter: str = "ib-hdr",
    nics_per_node: int | None = None,
) -> Topology:
    """Machines of different GPU kinds on one fabric: ``groups`` = [(nodes, gpus_per_node, gpu), …];
    hosts are numbered across groups in order (``node0`` …)."""
    nodes: list[Node] = [Node("fabric")]
    edges: list[Edge] = []
    index = 0
    for count, gpus, gpu in groups:
        for _ in range(count):
            _add_host(nodes, edges, f"node{index}", gpus, gpu, intra, inter, "fabric", nics_per_node or gpus)
            index += 1
    kinds = "+".join(f"{c}x{g}-{k}" for c, g, k in groups)
    return Topology(nodes, edges, f"hetero-{kinds}")
