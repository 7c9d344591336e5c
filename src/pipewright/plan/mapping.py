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
5. A map is dealt lazily: a (stage, replica) block is a slice of the order found by arithmetic, so
   making a 16,384-device map and reading the few blocks the planner prices costs O(t·cp), not O(n).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

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


class DeviceMap:
    """Devices of each (stage i, replica j, tp·cp rank k) of a mesh dealt from a device order.

    Built without listing its devices: stage i's replica j is the block ``order[g·B : (g + 1)·B]`` with
    B the devices per (stage, replica) and g = j·p + i (style ``"pp"``) or i·d + j (``"dp"``), so a
    16,384-device map costs O(1) to make and each lookup O(B). :attr:`grid` (every block) and
    :attr:`ranks` (the devices in global rank order, a lazy :class:`Ranks`) are made on demand; a map
    whose blocks were reordered (:func:`slowest_first`) holds its grid explicitly."""

    __slots__ = ("_grid", "_order", "_style", "dp", "pp", "tp")

    def __init__(
        self,
        tp: int,
        pp: int,
        dp: int,
        grid: tuple[tuple[tuple[str, ...], ...], ...] | None = None,
        order: Sequence[str] | None = None,
        style: str = "pp",
    ) -> None:
        if grid is None and order is None:
            raise ConfigError("a device map needs its grid or a device order")
        self.tp, self.pp, self.dp = tp, pp, dp
        self._order, self._style, self._grid = order, style, grid

    def block(self, i: int, j: int) -> tuple[str, ...]:
        """The B = tp·cp devices of stage i's replica j, tp fastest."""
        if self._grid is not None:
            return self._grid[i][j]
        g = j * self.pp + i if self._style == "pp" else i * self.dp + j
        return tuple(self._order[g * self.tp : (g + 1) * self.tp])

    def head(self, i: int) -> str:
        """Stage i's (replica 0, rank 0) device: the one the simulator prices the stage on."""
        if self._grid is not None:
            return self._grid[i][0][0]
        g = i if self._style == "pp" else i * self.dp
        return self._order[g * self.tp]

    @property
    def grid(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """``grid[i][j][k]``: every block (listed on first use)."""
        if self._grid is None:
            self._grid = tuple(tuple(self.block(i, j) for j in range(self.dp)) for i in range(self.pp))
        return self._grid

    @property
    def ranks(self) -> Ranks:
        """Device of global rank g = k + t·(j + d·i)."""
        return Ranks(self)

    def stage_devices(self, i: int) -> tuple[str, ...]:
        return tuple(d for j in range(self.dp) for d in self.block(i, j))


class Ranks(Sequence[str]):
    """A :class:`DeviceMap`'s devices in global rank order, listed only when iterated, hashed or
    compared (indexing one rank is O(1)): equal to, and hashing like, the tuple it stands for."""

    __slots__ = ("_map", "_tuple")

    def __init__(self, dmap: DeviceMap) -> None:
        self._map, self._tuple = dmap, None

    def __len__(self) -> int:
        m = self._map
        return m.tp * m.pp * m.dp

    def __getitem__(self, g):  # type: ignore[override]
        if isinstance(g, slice):
            return self.as_tuple()[g]
        m = self._map
        if g < 0:
            g += len(self)
        if not 0 <= g < len(self):
            raise IndexError(g)
        rest, k = divmod(g, m.tp)
        i, j = divmod(rest, m.dp)
        return m.block(i, j)[k]

    def as_tuple(self) -> tuple[str, ...]:
        if self._tuple is None:
            m = self._map
            self._tuple = tuple(d for i in range(m.pp) for j in range(m.dp) for d in m.block(i, j))
        return self._tuple

    def __iter__(self):
        return iter(self.as_tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranks):
            other = other.as_tuple()
        return self.as_tuple() == other

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return repr(self.as_tuple())


def map_devices(order: Sequence[str], tp: int, pp: int, dp: int, style: str = "pp") -> DeviceMap:
    """Deal ``order`` into tp groups, stages and replicas (module docstring, steps 2–3)."""
    n = tp * pp * dp
    if n > len(order):
        raise ConfigError(f"tp {tp} × pp {pp} × dp {dp} = {n} devices, but the topology has {len(order)}")
    if style not in STYLES:
        raise ConfigError(f"unknown mapping style {style!r}; choose one of: {', '.join(STYLES)}")
    return DeviceMap(tp, pp, dp, order=order, style=style)


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
