"""The (dp, pp, tp) process mesh.

Rank arithmetic follows Megatron's ``RankGenerator`` with order ``dp-pp-tp``: tensor-parallel ranks are
the fastest-varying (neighbouring ranks, same node), then pipeline, then data parallel::

    rank = (d · pp + p) · tp + t

:func:`rank_to_coords` / :func:`coords_to_rank` are that formula and its inverse (pure, no torch
process group needed); :class:`ParallelMesh` wraps ``torch.distributed.device_mesh.init_device_mesh``
with the same layout and adds what the pipeline runtime needs: the pipeline peers' global ranks, the
dp/tp groups and one process group per directed pipeline channel (see :meth:`ParallelMesh.channel`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipewright.runtime.errors import LayoutError

DIM_NAMES = ("dp", "pp", "tp")


def check_layout(world_size: int, dp: int, pp: int, tp: int) -> None:
    """Raise a one-line LayoutError unless dp · pp · tp = world size (all ≥ 1)."""
    if min(dp, pp, tp) < 1:
        raise LayoutError(f"parallel sizes must be at least 1 (got dp={dp}, pp={pp}, tp={tp})")
    if dp * pp * tp != world_size:
        raise LayoutError(
            f"dp × pp × tp = {dp}×{pp}×{tp} = {dp * pp * tp} but there are {world_size} processes; "
            f"choose sizes whose product is {world_size}"
        )


def rank_to_coords(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """Global rank → (dp, pp, tp) coordinates; inverse of :func:`coords_to_rank`."""
    if not 0 <= rank < dp * pp * tp:
        raise LayoutError(f"rank {rank} outside a {dp}×{pp}×{tp} mesh")
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def coords_to_rank(d: int, p: int, t: int, dp: int, pp: int, tp: int) -> int:
    """(dp, pp, tp) coordinates → global rank: ``(d · pp + p) · tp + t``."""
    return (d * pp + p) * tp + t


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelMesh:
    """This process's place in a dp × pp × tp mesh (build with :meth:`build`, after init_process_group)."""

    dp: int
    pp: int
    tp: int
    rank: int
    device: torch.device
    device_mesh: DeviceMesh | None = None
    _channels: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    _warm: set[tuple[int, int]] = field(default_factory=set, repr=False)

    @classmethod
    def build(
        cls, dp: int = 1, pp: int = 1, tp: int = 1, device: torch.device | str | None = None
    ) -> ParallelMesh:
        """Collective over all ranks: create the DeviceMesh (and its dp/pp/tp groups)."""
        world = dist.get_world_size()
        check_layout(world, dp, pp, tp)
        device = torch.device(device) if device is not None else default_device()
        mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=DIM_NAMES)
        return cls(dp, pp, tp, dist.get_rank(), device, mesh)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def coords(self) -> tuple[int, int, int]:
        return rank_to_coords(self.rank, self.dp, self.pp, self.tp)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

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

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's (dp, tp) replica."""
        d, _, t = self.coords
        return coords_to_rank(d, pp_rank, t, self.dp, self.pp, self.tp)

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
            for d in range(self.dp):
                for t in range(self.tp):
                    ranks = [coords_to_rank(d, q, t, self.dp, self.pp, self.tp) for q in (src, dst)]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
            self._channels[(src, dst)] = mine
        self._warm_up(sorted(set(pairs)))

    def _warm_up(self, pairs: list[tuple[int, int]]) -> None:
        """One tiny all-reduce per channel, in one global order: NCCL creates a communicator on first
        use and blocks until both ranks arrive, which must not happen mid-schedule."""
        for pair in pairs:
            group = self._channels.get(pair)
            if group is not None and pair not in self._warm:
                dist.all_reduce(torch.zeros(1, device=self.device), group=group)
                self._warm.add(pair)

    def channel(self, src_pp: int, dst_pp: int) -> dist.ProcessGroup:
        """The group carrying messages from pipeline rank ``src_pp`` to ``dst_pp`` (opened before)."""
        try:
            return self._channels[(src_pp, dst_pp)]
        except KeyError:
            raise LayoutError(
                f"no channel from pp rank {src_pp} to {dst_pp}; call open_channels first"
            ) from None
