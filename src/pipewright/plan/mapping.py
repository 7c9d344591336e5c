"""Device mapping on the actual topology graph: which devices form each tensor-parallel group, each
pipeline stage and each data-parallel replica.

1. **Order** (:func:`device_order`): a widest-first depth-first walk of the graph — Prim's maximum
   spanning tree grown from the first device, the frontier link of largest bandwidth taken first and, among
   equals, the most recently reached one (last in, first out). Devices joined by wide links therefore come
   out consecutively (a machine's NVLink devices before the walk leaves it over a NIC; a ring in ring
   order), without assuming hosts or levels: the order is read off the graph. O(E log E) for E links.
2. **Tensor-parallel groups** are t consecutive devices of that order: the fastest links.
3. **Stages and replicas**: the n/t groups, in order, are dealt either stage-major (``"pp"``: replica j's
   stage i is group j·p + i, so consecutive stages are neighbours on good links and data-parallel rings
   use what remains) or replica-major (``"dp"``: stage i's replicas are groups i·d … i·d + d − 1, the
   data-parallel ring on good links, Megatron's tp-dp-pp order). The search scores both.
4. The result is a device list in the mesh's global rank order (g = tp_rank + t·(dp_rank + d·pp_rank),
   :class:`~pipewright.mesh.Mesh`), which the simulator and the runtime both read as the mesh's
   placement (:func:`placement`: the device index of each rank). Within each stage the slowest
   device is put at (tp 0, dp 0), the device the simulator prices the stage on (a replicated stage
   runs at its slowest replica's pace).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.topology import Topology

STYLES = ("pp", "dp")


class DisconnectedTopologyError(ConfigError):
    """Some devices cannot reach the others."""


def device_order(topology: Topology) -> tuple[str, ...]:
    """Devices in widest-first depth-first order (module docstring, step 1); one-line error when the
    graph does not connect them all."""
    if not topology.devices:
        raise ConfigError(f"topology {topology.name} has no devices")
    start = topology.devices[0]
    seen = {start}
    order = [start]
    heap: list[tuple[float, int, str]] = []
    counter = 0
    for v, (bw, _) in topology.neighbours(start).items():
        counter += 1
        heapq.heappush(heap, (-bw, -counter, v))
    while heap:
        _, _, u = heapq.heappop(heap)
        if u in seen:
            continue
        seen.add(u)
        if topology.nodes[u].is_device:
            order.append(u)
        for v, (bw, _) in topology.neighbours(u).items():
            if v not in seen:
                counter += 1
                heapq.heappush(heap, (-bw, -counter, v))
    if len(order) < len(topology.devices):
        lost = next(d for d in topology.devices if d not in seen)
        raise DisconnectedTopologyError(
            f"topology {topology.name} is not connected: device {lost!r} cannot reach {start!r}; "
            "add a link to it"
        )
    return tuple(order)


@dataclass(frozen=True)
class DeviceMap:
    """Devices of each (stage, replica, tp rank): ``grid[i][j][k]``; :attr:`ranks` in global rank order."""

    tp: int
    pp: int
    dp: int
    grid: tuple[tuple[tuple[str, ...], ...], ...]

    @property
    def ranks(self) -> tuple[str, ...]:
        """Device of global rank g = k + t·(j + d·i)."""
        return tuple(dev for stage in self.grid for replica in stage for dev in replica)

    def stage_devices(self, i: int) -> tuple[str, ...]:
        return tuple(d for replica in self.grid[i] for d in replica)


def map_devices(order: Sequence[str], tp: int, pp: int, dp: int, style: str = "pp") -> DeviceMap:
    """Deal ``order`` into tp groups, stages and replicas (module docstring, steps 2–3)."""
    n = tp * pp * dp
    if n > len(order):
        raise ConfigError(f"tp {tp} × pp {pp} × dp {dp} = {n} devices, but the topology has {len(order)}")
    groups = [tuple(order[g * tp : (g + 1) * tp]) for g in range(pp * dp)]
    if style == "pp":
        grid = tuple(tuple(groups[j * pp + i] for j in range(dp)) for i in range(pp))
    elif style == "dp":
        grid = tuple(tuple(groups[i * dp + j] for j in range(dp)) for i in range(pp))
    else:
        raise ConfigError(f"unknown mapping style {style!r}; choose one of: {', '.join(STYLES)}")
    return DeviceMap(tp, pp, dp, grid)


def given_order(topology: Topology, tp: int, pp: int, dp: int) -> DeviceMap:
    """The topology's own device order in the mesh's rank order (the baseline 'devices as given')."""
    return map_devices(topology.devices, tp, pp, dp, style="dp")


def slowest_first(
    topology: Topology, dmap: DeviceMap, dtype: str, speeds: dict[str, float] | None = None
) -> DeviceMap:
    """``dmap`` with each stage's slowest tp group (by peak FLOP/s) moved to replica 0 and its slowest
    device to tp rank 0: the device the simulator prices the stage on. ``speeds``: a cache of peak
    FLOP/s per device (filled here); on one device kind the map is returned unchanged."""
    if speeds is None:
        speeds = {}
    if not speeds:
        for d in topology.devices:
            acc = topology.accelerator(d)
            speeds[d] = acc.peak_flops.get(dtype, min(acc.peak_flops.values()))
    if len(set(speeds.values())) == 1:
        return dmap
    speed = speeds.__getitem__
    grid = []
    for stage in dmap.grid:
        replicas = sorted(stage, key=lambda grp: min(map(speed, grp)))
        grid.append(tuple(tuple(sorted(grp, key=speed)) for grp in replicas))
    return DeviceMap(dmap.tp, dmap.pp, dmap.dp, tuple(grid))


def placement(topology: Topology, ranks: Sequence[str]) -> tuple[int, ...]:
    """The index into ``topology.devices`` of each rank's device: ``ranks`` as a
    :class:`~pipewright.mesh.Mesh` placement (the rank order the cost model, the simulator and the
    runtime share). One-line error for an unknown device or a device listed twice."""
    index = {d: i for i, d in enumerate(topology.devices)}
    out = tuple(index[topology.device(d)] for d in ranks)
    if len(set(out)) != len(out):
        raise ConfigError("the device assignment lists a device twice")
    return out
