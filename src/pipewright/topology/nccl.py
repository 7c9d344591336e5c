"""NCCL's own cost model of a collective, over pipewright's ring bus bandwidth.

A transcription of the model NCCL uses to choose an algorithm and a protocol (NCCL 2.18.3,
``src/graph/tuning.cc``: ``ncclTopoTuneModel`` fills a latency α and a bandwidth per collective,
algorithm and protocol; ``ncclTopoGetAlgoTime`` prices a call as α + bytes / bandwidth; the call
runs the cheapest pair). Latencies in µs, from NCCL's tables:

=========  ==================  =======================================================
term       value               meaning
=========  ==================  =======================================================
base       ring 6.6/14/8.4,    once per call (LL / LL128 / Simple)
           tree 6.8/14/0
hw NVLink  ring .6/1.9/3.4,    one step between two GPUs of a host over NVLink
           tree .6/1.25/4
hw PCI     ring 1/2.5/5.7,     one step inside a host without NVLink (or one GPU per host)
           tree 1/1.9/6
hw NET     ring 2.7/4/14,      one step across hosts (the network plugin adds 0 for IB/RoCE)
           tree 5/8.5/14
=========  ==================  =======================================================

With n ranks on N hosts (p = n/N per host):

- **ring** all-reduce: 2(n − 1) steps, 2N of them across hosts when N > 1; reduce-scatter and
  all-gather: n − 1 steps, N − 1 across. α = base + (steps − inter)·intra + inter·net, where intra
  is at least the network post overhead (1 µs; 3 µs for Simple) once N > 1. Bandwidth: the bus
  bandwidth B (Simple), B/4 for LL (B/3 on one host outside all-reduce), B·0.92 for LL128 (B·0.7
  with one GPU per host), times n/steps. A multi-host Simple all-reduce has its α × 1.4 (1.9 before
  Ampere), NCCL's "plateau effect of ring".
- **broadcast** (and reduce): a ring of n steps, each one hop of the host's or the network's class
  (the Simple protocol's hop uses the tree's Simple latency), full bandwidth B. This is NCCL's branch
  for rings whose channels differ; where its topology search keeps every channel the same (its first
  try) NCCL charges one hop, which understates a chain through n ranks.
- **tree** (all-reduce only): α = base + 2·((⌊p⌋ − 1)·intra + ⌊log₂N⌋·net); bandwidth B·0.92 (LL
  ×1/3.8, LL128 ×7/9 on one host, ×120/128 across) times 1/2, times NCCL's tree correction for
  messages under 512 MiB (a table by log₂ of bytes/64).

LL128 runs only where NCCL enables it by default: one GPU kind in the group, NVLink inside a host
(or one GPU per host). Left out: NCCL's per-channel caps (the model has no channel count; a ring of
one channel is assumed for the plateau's 64-bytes-per-rank threshold), CollNet/SHARP and NVLS (they
need switch support a topology file does not state), and the PAT algorithm of NCCL ≥ 2.23.
"""

from __future__ import annotations

from dataclasses import dataclass

#: LL, LL128, Simple
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 0.0)}
HW_US = {
    "nvlink": {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)},
    "pci": {"ring": (1.0, 2.5, 5.7), "tree": (1.0, 1.9, 6.0)},
    "net": {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)},
}
#: getNetOverhead on x86 Intel (and the default): µs per network post; × 3 for Simple
NET_OVERHEAD_US = 1.0
#: treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B … 256 MiB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
     1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9, 0.9, 0.9,
     0.9, 1.0, 1.0),
    (0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7,
     0.8, 0.9, 0.9),
)  # fmt: skip


@dataclass(frozen=True)
class Group:
    """What NCCL's model sees of a communicator: ``ranks``, ``hosts``, the class of a step inside a host
    (``intra``: "nvlink" or "pci"), the ring's bus bandwidth (bytes/s), whether LL128 is enabled, and
    whether every GPU is Ampere or newer (the ring plateau factor)."""

    ranks: int
    hosts: int
    intra: str
    bandwidth: float
    ll128: bool = True
    ampere: bool = True


def _log2i(x: int) -> int:
    """⌊log₂ x⌋ for x ≥ 1, 0 for x < 2 (NCCL's log2i)."""
    return max(int(x), 1).bit_length() - 1


def _steps(kind: str, g: Group) -> tuple[int, int]:
    """(steps, steps across hosts) of a ring ``kind`` (tuning.cc's nsteps and nInterSteps)."""
    n, hosts = g.ranks, g.hosts
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * hosts if hosts > 1 else 0
    if kind in ("reduce_scatter", "all_gather"):
        return n - 1, hosts - 1
    return n, hosts


def ring(kind: str, p: int, g: Group) -> tuple[float, float]:
    """(latency in s, algorithm bandwidth in bytes/s) of a ring with protocol index ``p``."""
    steps, inter = _steps(kind, g)
    multi = g.hosts > 1
    bus = g.bandwidth
    if p == 0:
        bus /= 4.0 if multi or kind == "all_reduce" else 3.0
    elif p == 1:
        bus *= 0.7 if g.ranks / g.hosts < 2 else 0.92
    lat = BASE_US["ring"][p]
    if kind == "broadcast":
        hw = HW_US["net" if multi else g.intra]
        lat += steps * (hw["tree"][p] if p == 2 else hw["ring"][p])
        return lat * 1e-6, bus
    intra = HW_US[g.intra]["ring"][p]
    if multi:
        intra = max(intra, NET_OVERHEAD_US * (3.0 if p == 2 else 1.0))
    lat += (steps - inter) * intra + inter * HW_US["net"]["ring"][p]
    return lat * 1e-6, bus * g.ranks / steps


def tree(p: int, g: Group) -> tuple[float, float]:
    """(latency in s, algorithm bandwidth in bytes/s) of NCCL's tree all-reduce with protocol ``p``."""
    bus = g.bandwidth * 0.92
    if p == 0:
        bus /= 3.8
    elif p == 1:
        bus *= 7.0 / 9.0 if g.hosts == 1 else 120.0 / 128.0
    per_host = g.ranks // g.hosts
    lat = BASE_US["tree"][p] + 2 * (
        (per_host - 1) * HW_US[g.intra]["tree"][p] + _log2i(g.hosts) * HW_US["net"]["tree"][p]
    )
    return lat * 1e-6, bus * 0.5


def collective_time(kind: str, nbytes: float, g: Group) -> float:
    """Seconds of collective ``kind`` (all_reduce, all_gather, reduce_scatter, broadcast) of ``nbytes``
    per rank: the cheapest (algorithm, protocol) pair NCCL's model allows (module docstring)."""
    best = float("inf")
    for p in range(len(PROTOCOLS)):
        if p == 1 and not g.ll128:
            continue
        lat, bw = ring(kind, p, g)
        if p == 2 and kind == "all_reduce" and g.hosts > 1 and nbytes / g.ranks >= 64:
            lat *= 1.4 if g.ampere else 1.9
        best = min(best, lat + nbytes / bw)
        if kind == "all_reduce":
            lat, bw = tree(p, g)
            log_size = _log2i(int(nbytes) >> 6)
            if log_size < len(TREE_CORRECTION[p]):
                bw *= TREE_CORRECTION[p][log_size]
            best = min(best, lat + nbytes / bw)
    return best
