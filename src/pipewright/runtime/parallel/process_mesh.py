"""The (tp, pp, dp) process mesh of a distributed run.

The rank arithmetic is :mod:`pipewright.mesh`'s (the one the simulator's cost model uses): by default
Megatron's order ``tp-dp-pp``, tensor-parallel ranks fastest-varying (neighbouring ranks, same node),
then data parallel, then pipeline::

    rank = t + tp · (d + dp · p)

The process launched as global rank g (on device g: ``cuda:LOCAL_RANK`` of node-major launches) plays
the mesh rank placed on device g. :func:`rank_to_coords` / :func:`coords_to_rank` are that formula and
its inverse (pure, no process group needed); :class:`ParallelMesh` builds a torch ``DeviceMesh`` whose
dimensions follow the order (outermost first) and adds what the pipeline runtime needs: the pipeline
peers' global ranks, the dp/tp groups and one process group per directed pipeline channel (see
:meth:`ParallelMesh.channel`). With expert parallelism (``ep`` > 1, carved from dp: see
:mod:`pipewright.mesh`) it also holds this rank's ep group (the experts' all-to-all) and
expert-data-parallel group (the experts' gradient reduction).

Context parallelism (``cp`` > 1) adds a fourth dimension right after tp (Megatron's ``tp-cp-dp-pp``:
rank = t + tp·(c + cp·(d + dp·p))); the DeviceMesh then has a ``cp`` dimension, the pipeline peers and
channels of a rank are those of its own cp slice, and :attr:`ParallelMesh.cp_group` is its ring.
With dp > 1 as well, :attr:`ParallelMesh.grad_group` is the data-and-context group (Megatron-LM's):
the dp × cp ranks holding the same parameters, over which the gradients are averaged in one
all-reduce rather than one over cp and another over dp.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER, Mesh
from pipewright.runtime.core.distributed_errors import LayoutError
from pipewright.runtime.reliability.timeouts import new_group


def check_layout(world_size: int, dp: int, pp: int, tp: int, cp: int = 1) -> None:
    """Raise a one-line LayoutError unless dp · pp · tp (· cp) = world size (all ≥ 1)."""
    if min(dp, pp, tp, cp) < 1:
        raise LayoutError(f"parallel sizes must be at least 1 (got dp={dp}, pp={pp}, tp={tp}, cp={cp})")
    if cp > 1 and dp * pp * tp * cp != world_size:
        raise LayoutError(
            f"dp × pp × tp × cp = {dp}×{pp}×{tp}×{cp} = {dp * pp * tp * cp} but there are {world_size} "
            f"processes; choose sizes whose product is {world_size}"
        )
    if cp == 1 and dp * pp * tp != world_size:
        raise LayoutError(
            f"dp × pp × tp = {dp}×{pp}×{tp} = {dp * pp * tp} but there are {world_size} processes; "
            f"choose sizes whose product is {world_size}"
        )


def _mesh(dp: int, pp: int, tp: int, order: str = DEFAULT_ORDER, cp: int = 1) -> Mesh:
    try:
        return Mesh(tp=tp, pp=pp, dp=dp, order=order, cp=cp)
    except ConfigError as exc:
        raise LayoutError(str(exc)) from None


def rank_to_coords(rank: int, dp: int, pp: int, tp: int, order: str = DEFAULT_ORDER) -> tuple[int, int, int]:
    """Global rank → (dp, pp, tp) coordinates in ``order``; inverse of :func:`coords_to_rank`."""
    if not 0 <= rank < dp * pp * tp:
        raise LayoutError(f"rank {rank} outside a {dp}×{pp}×{tp} mesh")
    c = _mesh(dp, pp, tp, order).coords(rank)
    return c.dp, c.pp, c.tp


def coords_to_rank(d: int, p: int, t: int, dp: int, pp: int, tp: int, order: str = DEFAULT_ORDER) -> int:
    """(dp, pp, tp) coordinates → global rank in ``order`` (default: ``t + tp · (d + dp · p)``)."""
    return _mesh(dp, pp, tp, order).rank(tp=t, pp=p, dp=d)


def device_grid(layout: Mesh) -> list:
    """The process ranks of ``layout`` as nested lists, outermost dimension first: the DeviceMesh
    array (entry = the process, i.e. device, that holds those coordinates)."""
    if layout.cp > 1:
        return _grid4(layout)
    return [[[layout.device_index(r) for r in row] for row in plane] for plane in layout.grid()]


def _grid4(layout: Mesh) -> list:
    """:func:`device_grid` with a cp dimension: four nested levels, ``reversed(layout.dims)``."""
    dims = tuple(reversed(layout.dims))

    def level(fixed: dict[str, int]) -> list | int:
        if len(fixed) == len(dims):
            return layout.device_index(layout.rank(**fixed))
        name = dims[len(fixed)]
        return [level({**fixed, name: i}) for i in range(getattr(layout, name))]

    return level({})


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelMesh:
    """This process's place in a dp × pp × tp mesh (build with :meth:`build`, after init_process_group).

    ``layout``: the pure :class:`pipewright.mesh.Mesh` (order and placement) all coordinates come from;
    ``rank`` is this process's global rank, which runs on device ``rank``.
    """

    dp: int
    pp: int
    tp: int
    rank: int
    device: torch.device
    device_mesh: DeviceMesh | None = None
    layout: Mesh | None = None
    cp: int = 1
    ep: int = 1
    ep_group: Any = field(default=None, repr=False)  # the experts' all-to-all group (ep > 1)
    expert_dp_group: Any = field(default=None, repr=False)  # the experts' gradient group (ep > 1)
    ep_back_group: Any = field(default=None, repr=False)  # the ep ranks again: backward all-to-alls
    dp_cp_group: Any = field(default=None, repr=False)  # the dp × cp ranks of one (pp, tp) (cp, dp > 1)
    expert_dp_cp_group: Any = field(default=None, repr=False)  # expert-dp × cp ranks (ep, cp > 1)
    _channels: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    _warm: set[tuple[int, int]] = field(default_factory=set, repr=False)
    _coords: tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False)
    _cp_rank: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = _mesh(self.dp, self.pp, self.tp, cp=self.cp)
        elif (self.layout.dp, self.layout.pp, self.layout.tp, self.layout.cp) != self.sizes:
            raise LayoutError(
                f"mesh layout {self.layout} does not match "
                f"dp={self.dp}, pp={self.pp}, tp={self.tp}, cp={self.cp}"
            )
        c = self.layout.coords(self.layout.rank_on_device(self.rank))
        self._coords = (c.dp, c.pp, c.tp)  # read on every message: computed once
        self._cp_rank = c.cp

    @classmethod
    def build(
        cls,
        dp: int = 1,
        pp: int = 1,
        tp: int = 1,
        device: torch.device | str | None = None,
        *,
        order: str = DEFAULT_ORDER,
        placement: Iterable[int] | None = None,
        ep: int = 1,
        cp: int = 1,
    ) -> ParallelMesh:
        """Collective over all ranks: create the DeviceMesh (and its dp/pp/tp groups; cp's when ``cp`` > 1;
        with ``ep`` > 1 the ep and expert-data-parallel groups, and a second ep group for the backward's
        all-to-alls, so that an overlapped F&B pair's two threads never share a group). ``order`` and
        ``placement``: see :mod:`pipewright.mesh` (a plan's chosen rank order / device list)."""
        world = dist.get_world_size()
        check_layout(world, dp, pp, tp, cp)
        try:
            layout = Mesh(tp, pp, dp, order, None if placement is None else tuple(placement), ep=ep, cp=cp)
        except ConfigError as exc:
            raise LayoutError(str(exc)) from None
        device = torch.device(device) if device is not None else default_device()
        mesh = DeviceMesh(device.type, device_grid(layout), mesh_dim_names=tuple(reversed(layout.dims)))
        groups = {}
        if ep > 1:
            me = layout.rank_on_device(dist.get_rank())
            named = [
                ("ep_group", layout.ep_groups(), layout.ep_group(me)),
                ("expert_dp_group", layout.expert_dp_groups(), layout.expert_dp_group(me)),
                ("ep_back_group", layout.ep_groups(), layout.ep_group(me)),
            ]
            if cp > 1:
                named.append(
                    ("expert_dp_cp_group", layout.expert_dp_cp_groups(), layout.expert_dp_cp_group(me))
                )
            for name, every, mine in named:
                for ranks in every:  # every rank creates every group, in one order
                    group = new_group([layout.device_index(r) for r in ranks])
                    if ranks == mine:
                        groups[name] = group
        if cp > 1 and dp > 1:  # every rank creates every (pp, tp)'s dp × cp group, in one order
            me = layout.coords(layout.rank_on_device(dist.get_rank()))
            for p in range(pp):
                for t in range(tp):
                    ranks = [
                        layout.device_index(layout.rank(tp=t, pp=p, dp=d, cp=c))
                        for d in range(dp)
                        for c in range(cp)
                    ]
                    group = new_group(ranks)
                    if (p, t) == (me.pp, me.tp):
                        groups["dp_cp_group"] = group
        return cls(dp, pp, tp, dist.get_rank(), device, mesh, layout, cp=cp, ep=ep, **groups)

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (dp rank mod ep)."""
        return self.dp_rank % self.ep

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(dp, pp, tp, cp)."""
        return self.dp, self.pp, self.tp, self.cp

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp, pp, tp) of this process (the mesh rank placed on its device)."""
        return self._coords

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def cp_rank(self) -> int:
        """This process's context-parallel rank (0 without context parallelism)."""
        return self._cp_rank

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel ring through this rank (None when cp = 1)."""
        return self.group("cp") if self.cp > 1 else None

    def process_of(self, d: int, p: int, t: int, c: int | None = None) -> int:
        """The global process rank that holds coordinates (dp d, pp p, tp t) and cp ``c`` (default:
        this rank's cp coordinate)."""
        c = self._cp_rank if c is None else c
        return self.layout.device_index(self.layout.rank(tp=t, pp=p, dp=d, cp=c))

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along ``dim`` ("dp", "pp" or "tp") containing this rank."""
        return None if self.device_mesh is None else self.device_mesh.get_group(dim)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.group("pp")

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """The group the gradients are averaged over: dp × cp (one all-reduce) with context
        parallelism, else dp."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    @property
    def grad_replicas(self) -> int:
        """The size of :attr:`grad_group`: the replicas whose gradients are averaged."""
        return self.dp * self.cp if self.dp_cp_group is not None else self.dp

    @property
    def expert_grad_group(self) -> dist.ProcessGroup | None:
        """The group the experts' gradients are averaged over (ep > 1): expert-dp × cp (one
        all-reduce) with context parallelism, else expert-dp."""
        return self.expert_dp_cp_group if self.expert_dp_cp_group is not None else self.expert_dp_group

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's (dp, tp) replica."""
        d, _, t = self.coords
        return self.process_of(d, pp_rank, t)

    def replicas(self) -> list[tuple[int, int, int]]:
        """Every (dp, tp, cp) coordinate: one pipeline each (the same order on every rank)."""
        return [(d, t, c) for d in range(self.dp) for t in range(self.tp) for c in range(self.cp)]

    def open_channels(self, pairs: Iterable[tuple[int, int]] = ()) -> None:
        """Collective over all ranks: one process group per directed pipeline pair (src_pp, dst_pp).

        A group per direction keeps each channel's traffic one-way and in a fixed order, so receives can
        be posted long before they are needed without blocking sends the other way (NCCL serialises the
        operations of one communicator) and without tags (NCCL has none). Pairs already open are kept.
        """
        ring = {(r, (r + d) % self.pp) for r in range(self.pp) for d in (1, -1)}
        pairs = {(a, b) for a, b in {*ring, *pairs} if a != b}
        for src, dst in sorted(pairs):
            if (src, dst) in self._channels or src == dst:
                continue
            mine = None
            for d, t, c in self.replicas():
                ranks = [self.process_of(d, q, t, c) for q in (src, dst)]
                group = new_group(ranks)
                if self.rank in ranks:
                    mine = group
            self._channels[(src, dst)] = mine
        self._warm_up(sorted(set(pairs)))

    def _warm_up(self, pairs: list[tuple[int, int]]) -> None:
        """A one-element send from ``src`` to ``dst`` on each channel (src, dst), in one global order
        (``pairs`` sorted, the same on every rank). NCCL opens a communicator's point-to-point
        connections lazily, on its first send/receive between two ranks, blocking until both arrive
        — an all-reduce opens only the collective's ring, not them. Left to the first step, those
        handshakes meet the step's pre-posted receives and can wait on each other in a cycle; here
        every rank meets its channels in the same order, so the first pair in that order not yet
        done always has both of its ranks at it."""
        for src, dst in pairs:
            group = self._channels.get((src, dst))
            if group is None or (src, dst) in self._warm:
                continue
            token = torch.zeros(1, device=self.device)
            if self.pp_rank == src:
                dist.send(token, dst=self.pp_peer(dst), group=group)
            else:
                dist.recv(token, src=self.pp_peer(src), group=group)
            self._warm.add((src, dst))

    def channel(self, src_pp: int, dst_pp: int) -> dist.ProcessGroup:
        """The group carrying messages from pipeline rank ``src_pp`` to ``dst_pp`` (opened before)."""
        try:
            return self._channels[(src_pp, dst_pp)]
        except KeyError:
            raise LayoutError(
                f"no channel from pp rank {src_pp} to {dst_pp}; call open_channels first"
            ) from None
