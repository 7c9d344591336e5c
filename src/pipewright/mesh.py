"""The (tp, cp, pp, dp) parallel mesh: one rank order shared by the cost model, the simulator and the
runtime.

An *order* lists the three dimensions innermost (fastest-varying) first, as Megatron-Core's
``RankGenerator`` writes it. The default, Megatron's ``"tp-dp-pp"``, numbers ranks

    rank = t + tp · (d + dp · p)

so a tensor-parallel group is ``tp`` neighbouring ranks (one machine, NVLink), the data-parallel replicas
of a stage come next and pipeline neighbours sit ``tp · dp`` ranks apart. ``"tp-pp-dp"`` gives
``rank = t + tp · (p + pp · d)`` (each data-parallel replica one contiguous block). Any permutation of
the three names is accepted.

Context parallelism (``cp`` > 1: the cost model's ring attention and the runtime's ``--cp``) adds a fourth
dimension. An order may name it (``"tp-cp-dp-pp"``, Megatron's); an order without it places cp right
after tp (so ``"tp-dp-pp"`` with cp > 1 numbers ranks as ``"tp-cp-dp-pp"``: rank =
t + tp·(c + cp·(d + dp·p))). With cp = 1 every rank and group is the three-dimensional one.

Expert parallelism (``ep``) is carved from the data-parallel ranks, as Megatron-Core does: ep divides
dp, and data-parallel rank d is expert-parallel rank d mod ep of expert-data-parallel rank ⌊d / ep⌋. An
ep group is ep consecutive dp ranks (same tp, pp, cp); the expert-data-parallel group (the replicas
of one set of experts, over which their gradients are reduced) is the dp/ep ranks with the same ep
rank. ep adds no ranks: the world is still tp·cp·pp·dp.

Global rank r runs on device ``placement[r]`` (an index into a topology's devices, or the process
launched on that device); without an explicit placement, rank r runs on device r. A plan that chooses
its own placement gives it as that device list.

Pure Python (no torch): :class:`pipewright.cost.comm.TopologyComm` prices messages between the devices
this module assigns, and :class:`pipewright.runtime.parallel.process_mesh.ParallelMesh` builds its process
groups from
the same arithmetic, so the simulator and the runtime put every (tp, pp, dp) coordinate on one device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipewright.errors import ConfigError

DIMS = ("tp", "pp", "dp")
#: every dimension, context parallelism included
ALL_DIMS = ("tp", "cp", "pp", "dp")
#: Megatron-LM's default order (``RankGenerator(order="tp-cp-ep-dp-pp")`` without cp/ep).
DEFAULT_ORDER = "tp-dp-pp"


class Coords(NamedTuple):
    """A rank's position: tensor-, pipeline-, data- and context-parallel rank."""

    tp: int
    pp: int
    dp: int
    cp: int = 0


def check_ep(ep: int, dp: int) -> None:
    """One-line ConfigError unless ``ep`` ≥ 1 divides ``dp`` (expert parallelism is carved from the
    data-parallel ranks: module docstring)."""
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ConfigError(
            f"--ep {ep} must divide --dp {dp} (expert parallelism is carved from the data-parallel "
            "ranks); choose ep dividing dp"
        )


def parse_order(order: str | Sequence[str]) -> tuple[str, ...]:
    """``"tp-dp-pp"`` (or a sequence of names) → ``("tp", "dp", "pp")``, innermost first; one-line
    ConfigError unless it is a permutation of tp, pp and dp (and optionally cp)."""
    names = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
    if sorted(names) not in (sorted(DIMS), sorted(ALL_DIMS)):
        raise ConfigError(
            f"rank order {'-'.join(names) if names else order!r} must name tp, pp and dp once each "
            f"(and optionally cp), innermost first (e.g. {DEFAULT_ORDER} or tp-cp-dp-pp)"
        )
    return names


def with_cp(dims: Sequence[str]) -> tuple[str, ...]:
    """``dims`` with cp placed right after tp where it is not named (Megatron's tp-cp-…)."""
    if "cp" in dims:
        return tuple(dims)
    i = list(dims).index("tp") + 1
    return (*dims[:i], "cp", *dims[i:])


@dataclass(frozen=True)
class Mesh:
    """``tp`` × ``pp`` × ``dp`` ranks numbered in ``order`` (module docstring), placed on ``placement``.

    ``placement``: the device index of every global rank (a permutation of ``range(size)``; None =
    identity). ``cp``: context-parallel size (module docstring).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER
    placement: tuple[int, ...] | None = None
    cp: int = 1
    ep: int = 1
    _strides: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ALL_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be at least 1 (got {value})")
        check_ep(self.ep, self.dp)
        dims = parse_order(self.order)
        if self.cp > 1:
            dims = with_cp(dims)
        object.__setattr__(self, "order", "-".join(dims))
        dims = with_cp(dims)
        for i, d in enumerate(dims):
            self._strides[d] = math.prod(getattr(self, x) for x in dims[:i])
        if self.placement is not None:
            placement = tuple(int(x) for x in self.placement)
            if sorted(placement) != list(range(self.size)):
                raise ConfigError(
                    f"device placement {list(placement)} must list each of the {self.size} devices "
                    f"0…{self.size - 1} once (one per rank of {self._sizes()})"
                )
            object.__setattr__(self, "placement", None if placement == tuple(range(self.size)) else placement)

    # -- sizes and strides ------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dims(self) -> tuple[str, ...]:
        """The dimension names innermost first (cp only where the order names it, or cp > 1)."""
        return parse_order(self.order)

    def _sizes(self) -> str:
        cp = f" × cp {self.cp}" if self.cp > 1 else ""
        return f"tp {self.tp}{cp} × pp {self.pp} × dp {self.dp}"

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along ``dim``: the product of the sizes inside it."""
        return self._strides[dim]

    # -- rank arithmetic ---------------------------------------------------------------------------
    def rank(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        """Coordinates → global rank: Σ over dims of coordinate × stride."""
        for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
            if not 0 <= value < getattr(self, name):
                raise ConfigError(f"{name} rank {value} outside the mesh's {name} = {getattr(self, name)}")
        return (
            tp * self.stride("tp") + pp * self.stride("pp") + dp * self.stride("dp") + cp * self.stride("cp")
        )

    def coords(self, rank: int) -> Coords:
        """Global rank → coordinates (inverse of :meth:`rank`)."""
        if not 0 <= rank < self.size:
            raise ConfigError(f"rank {rank} outside a {self._sizes()} mesh")
        return Coords(*((rank // self.stride(d)) % getattr(self, d) for d in (*DIMS, "cp")))

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The global ranks along ``dim`` through ``rank`` (its tp, pp or dp group), in ``dim`` order."""
        c = self.coords(rank)._asdict()
        out = []
        for i in range(getattr(self, dim)):
            c[dim] = i
            out.append(self.rank(**c))
        return tuple(out)

    def groups(self, dim: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``dim``, ordered by their smallest rank."""
        return tuple(sorted({self.group(dim, r) for r in range(self.size)}))

    def grid(self) -> list:
        """The global ranks as nested lists, outermost dimension first (``grid[a][b][c]`` with the
        dims of ``reversed(self.dims)``): the shape of a torch DeviceMesh over this order (three
        dimensions: the runtime runs cp = 1)."""
        if self.cp > 1:
            raise ConfigError(f"the runtime runs without context parallelism; got cp = {self.cp}")
        outer, middle, inner = (d for d in reversed(self.dims) if d != "cp")
        return [
            [
                [self.rank(**{outer: a, middle: b, inner: c}) for c in range(getattr(self, inner))]
                for b in range(getattr(self, middle))
            ]
            for a in range(getattr(self, outer))
        ]

    # -- placement -------------------------------------------------------------------------------
    def device_index(self, rank: int) -> int:
        """The device global rank ``rank`` runs on (an index into the topology's device list)."""
        self.coords(rank)
        return rank if self.placement is None else self.placement[rank]

    def rank_on_device(self, device: int) -> int:
        """The global rank that runs on device ``device`` (inverse of :meth:`device_index`)."""
        if not 0 <= device < self.size:
            raise ConfigError(f"device {device} outside a mesh of {self.size} devices")
        return device if self.placement is None else self.placement.index(device)

    def device_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """The device index of coordinates (tp, pp, dp)."""
        return self.device_index(self.rank(tp, pp, dp))

    # -- compatibility with the cost model's positional names ----------------------------------------
    def global_rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """:meth:`rank` with the pipeline coordinate first."""
        return self.rank(tp=tp_rank, pp=pp_rank, dp=dp_rank)

    def tp_group(self, pp_rank: int, dp_rank: int = 0) -> tuple[int, ...]:
        return self.group("tp", self.global_rank(pp_rank, dp_rank))

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        return self.group("dp", self.global_rank(pp_rank, 0, tp_rank))

    def cp_group(self, pp_rank: int, dp_rank: int = 0) -> tuple[int, ...]:
        return self.group("cp", self.global_rank(pp_rank, dp_rank))

    def grad_group(self, pp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The ranks that hold the same parameters (gradients reduced over them): dp × cp replicas,
        in rank order (Megatron reduces gradients over its data-and-context-parallel group)."""
        return tuple(
            sorted(
                self.rank(tp=tp_rank, pp=pp_rank, dp=d, cp=c) for d in range(self.dp) for c in range(self.cp)
            )
        )

    def pp_group(self, dp_rank: int = 0, tp_rank: int = 0) -> tuple[int, ...]:
        return self.group("pp", self.global_rank(0, dp_rank, tp_rank))

    # -- expert parallelism (carved from dp) --------------------------------------------------------
    def ep_rank(self, rank: int) -> int:
        """The expert-parallel rank of global rank ``rank``: its dp rank mod ep."""
        return self.coords(rank).dp % self.ep

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ep consecutive dp ranks through ``rank`` that share its experts' tokens (all-to-all)."""
        dp = self.group("dp", rank)
        start = self.coords(rank).dp // self.ep * self.ep
        return dp[start : start + self.ep]

    def expert_dp_group(self, rank: int) -> tuple[int, ...]:
        """The dp/ep ranks through ``rank`` holding the same experts (their gradients reduced over it)."""
        return self.group("dp", rank)[self.ep_rank(rank) :: self.ep]

    def ep_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every ep group, ordered by their smallest rank."""
        return tuple(sorted({self.ep_group(r) for r in range(self.size)}))

    def expert_dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every expert-data-parallel group, ordered by their smallest rank."""
        return tuple(sorted({self.expert_dp_group(r) for r in range(self.size)}))

    def expert_dp_cp_group(self, rank: int) -> tuple[int, ...]:
        """:meth:`expert_dp_group` × every cp rank: the ranks holding ``rank``'s experts (their
        gradients reduced over it at once, as Megatron's expert data-and-context-parallel group)."""
        dps = [self.coords(r).dp for r in self.expert_dp_group(rank)]
        c = self.coords(rank)
        return tuple(sorted(self.rank(tp=c.tp, pp=c.pp, dp=d, cp=k) for d in dps for k in range(self.cp)))

    def expert_dp_cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every :meth:`expert_dp_cp_group`, ordered by their smallest rank."""
        return tuple(sorted({self.expert_dp_cp_group(r) for r in range(self.size)}))
