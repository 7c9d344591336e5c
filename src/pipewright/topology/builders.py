"""Topology builders: a cluster of NVSwitch machines on one fabric, a ring, this machine over loopback,
a leaf/spine fabric, and machines of mixed GPU kinds. The GPU clusters (:func:`cluster`,
:func:`two_tier`, :func:`heterogeneous`) price collectives by NCCL's model (``collectives="nccl"``);
:func:`ring` and :func:`single_host` by the α–β ring/tree."""

from __future__ import annotations

from collections.abc import Sequence

from pipewright.errors import PipewrightError
from pipewright.hardware import accelerator, link
from pipewright.topology.elements import Edge, Node
from pipewright.topology.graph import Topology


def _link_edge(a: str, b: str, kind: str, via_switch: bool = True, count: int = 1) -> Edge:
    """An edge of link ``kind``; a device–switch edge carries half the link latency so that
    device → switch → device costs the catalogue latency once."""
    spec = link(kind)
    return Edge(a, b, spec.name, spec.bandwidth * count, spec.latency / 2 if via_switch else spec.latency)


def _library(gpu: str) -> str:
    """The collective model of a cluster of ``gpu``: NCCL's for GPUs, the α–β ring/tree for CPU
    processes (gloo)."""
    return "alpha-beta" if gpu == "cpu" else "nccl"


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
    inter: str | None = None,
    nics_per_node: int | None = None,
) -> Topology:
    """``nodes`` machines of ``gpus_per_node`` GPUs: an NVSwitch-style switch inside each machine (link
    ``intra``; "nvlink" = the GPU's NVLink generation) and one non-blocking fabric switch between them
    (link ``inter``; default the GPU's usual fabric, ``Accelerator.fabric``: HDR for A100, NDR for
    H100/H200/B200 — a rail-optimised fat tree is non-blocking for the rail-aligned traffic of
    collectives), reached through ``nics_per_node`` NICs (default: one per GPU, as Selene's 8×HDR per
    DGX A100 and the 8×NDR of a DGX H100). Devices are named ``node{i}/gpu{j}``, rank order node-major."""
    if inter is None:
        inter = accelerator(gpu).fabric if gpu != "cpu" else "eth-25g"
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
    return Topology(out_nodes, edges, f"{nodes}x{gpus_per_node}-{gpu}", _library(gpu))


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
    return Topology(nodes, edges, f"two-tier-{leaves}x{nodes_per_leaf}x{gpus_per_node}-{gpu}", _library(gpu))


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
    library = "nccl" if all(_library(g) == "nccl" for _, _, g in groups) else "alpha-beta"
    return Topology(nodes, edges, f"hetero-{kinds}", library)
