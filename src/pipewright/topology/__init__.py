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

The smaller of the two is taken. This is the ``alpha-beta`` collective model (hand-written graphs,
:func:`ring`, :func:`single_host`, files without a ``collectives`` field); the GPU cluster builders
(:func:`cluster`, :func:`two_tier`, :func:`heterogeneous`) use ``nccl``, NCCL's own algorithm and
protocol model over the same B (:mod:`pipewright.topology.nccl`). ``Topology.collectives`` names the
model; :data:`COLLECTIVE_MODELS` registers them.

B is the smallest, over ring neighbours, of: the pair's path bandwidth when both sit on one host; and,
for a pair on two hosts, the pair's path bandwidth times the number of parallel rings (the fewer group
members on either host — NCCL runs one ring per NIC), capped by either host's egress (the smaller of the
bandwidth of all links leaving the host and the members' own widest paths off it). Oversubscription
inside the fabric beyond that is seen only through the pair bandwidth.

**JSON schema** (``Topology.to_json`` / ``Topology.from_json``, ``save`` / ``load``)::

    {"format": "pipewright-topology", "version": 1, "name": "selene-4x8", "collectives": "nccl",
     "nodes": [{"name": "node0/gpu0", "type": "device", "accelerator": "a100-80gb", "host": "node0"},
               {"name": "fabric", "type": "switch", "host": null}],
     "links": [{"a": "node0/gpu0", "b": "fabric", "kind": "ib-hdr",
                "bandwidth": 25e9, "latency": 2.5e-6}]}

``collectives`` is optional ("alpha-beta" when absent, or "nccl"). ``type`` is "device" or "switch";
``accelerator`` is required for devices; ``host`` is optional (a string; ``null`` for fabric switches).
In links, ``bandwidth`` and ``latency`` are optional and default to the catalogue values of ``kind`` (a
:func:`pipewright.hardware.link` name; any string when both are given). Devices are numbered in the
order they are listed: that order is the rank order.
"""

from pipewright.topology.builders import cluster, heterogeneous, ring, single_host, two_tier
from pipewright.topology.elements import Edge, Node
from pipewright.topology.graph import COLLECTIVE_MODELS, COLLECTIVES, Topology
from pipewright.topology.routes import PathInfo
from pipewright.topology.schema import FORMAT

__all__ = [
    "COLLECTIVES",
    "COLLECTIVE_MODELS",
    "FORMAT",
    "Edge",
    "Node",
    "PathInfo",
    "Topology",
    "cluster",
    "heterogeneous",
    "ring",
    "single_host",
    "two_tier",
]
