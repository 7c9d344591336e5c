"""One rank order: the device the simulator's comm model assigns to each (tp, pp, dp) coordinate is the
device of the process the runtime's mesh gives those coordinates, for every order and a placement."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from pipewright.cost.comm import TopologyComm
from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER, Mesh, parse_order
from pipewright.topology import cluster

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "pp", "dp"))]


def _runtime_device(layout: Mesh, tp: int, pp: int, dp: int) -> int:
    """The process (= device index) the runtime's ParallelMesh puts at (tp, pp, dp): the DeviceMesh grid
    it builds, indexed by the order's dims (outermost first)."""
    from pipewright.runtime.parallel.process_mesh import device_grid

    coords = {"tp": tp, "pp": pp, "dp": dp}
    a, b, c = (coords[d] for d in reversed(layout.dims))
    return device_grid(layout)[a][b][c]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("placement", [None, "reversed"])
def test_simulator_and_runtime_put_each_coordinate_on_one_device(order: str, placement: str | None) -> None:
    from pipewright.runtime.parallel.process_mesh import ParallelMesh

    tp, pp, dp = 2, 4, 2
    devices = tuple(reversed(range(16))) if placement else None
    layout = Mesh(tp, pp, dp, order, devices)
    topo = cluster(2, 8)
    comm = TopologyComm(topo, layout)
    for t, p, d in itertools.product(range(tp), range(pp), range(dp)):
        process = _runtime_device(layout, t, p, d)
        assert comm.device_of(tp=t, pp=p, dp=d) == topo.devices[process]
        # the process launched as that global rank reports the same coordinates
        mesh = ParallelMesh(dp, pp, tp, process, None, layout=layout)  # type: ignore[arg-type]
        assert mesh.coords == (d, p, t)
        assert mesh.pp_peer(p) == process
    # the simulated pipeline (tp 0, dp 0) sits where the runtime's pp group of process 0's replica sits
    for p in range(pp):
        assert comm.device(p) == topo.devices[_runtime_device(layout, 0, p, 0)]


def test_default_order_is_megatrons_tp_dp_pp() -> None:
    m = Mesh(tp=2, pp=2, dp=2)
    assert m.order == DEFAULT_ORDER == "tp-dp-pp"
    assert [m.rank(tp=t, dp=d, pp=p) for p in (0, 1) for d in (0, 1) for t in (0, 1)] == list(range(8))
    assert m.group("tp", 4) == (4, 5) and m.group("dp", 4) == (4, 6) and m.group("pp", 3) == (3, 7)
    # tp-pp-dp: each data-parallel replica is one contiguous block of ranks
    assert Mesh(2, 2, 2, "tp-pp-dp").group("pp", 0) == (0, 2)
    assert Mesh(2, 2, 2, "tp-pp-dp").groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    # on 8-GPU nodes, a tp group of 8 stays on a node and pipeline neighbours are tp·dp devices apart
    comm = TopologyComm(cluster(4, 8), Mesh(tp=8, pp=2, dp=2))
    assert {comm.device_of(tp=t).split("/")[0] for t in range(8)} == {"node0"}
    assert comm.device(1) == "node2/gpu0"


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    hs.integers(1, 4),
    hs.integers(1, 4),
    hs.integers(1, 4),
    hs.sampled_from(ORDERS),
    hs.randoms(use_true_random=False),
)
def test_rank_coords_round_trip(tp: int, pp: int, dp: int, order: str, rnd) -> None:
    devices = list(range(tp * pp * dp))
    rnd.shuffle(devices)
    m = Mesh(tp, pp, dp, order, tuple(devices))
    seen = set()
    for r in range(m.size):
        c = m.coords(r)
        assert m.rank(*c) == r
        assert m.rank_on_device(m.device_index(r)) == r
        seen.add(c)
    assert len(seen) == m.size
    for dim in ("tp", "pp", "dp"):
        groups = m.groups(dim)
        assert sorted(x for g in groups for x in g) == list(range(m.size))
        assert all(len(g) == getattr(m, dim) for g in groups)


def test_bad_orders_and_placements_are_one_line_errors() -> None:
    assert parse_order("pp-tp-dp") == ("pp", "tp", "dp")
    with pytest.raises(ConfigError, match="must name tp, pp and dp once each"):
        Mesh(order="tp-dp")
    with pytest.raises(ConfigError, match="must list each of the 4 devices"):
        Mesh(tp=2, pp=2, placement=(0, 1, 2, 2))
    with pytest.raises(ConfigError, match="--pp must be at least 1"):
        Mesh(pp=0)


def _gloo_coords(rank: int, orders: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist

    from pipewright.runtime.parallel.process_mesh import ParallelMesh

    torch.set_num_threads(1)
    out = {}
    for order in orders:
        mesh = ParallelMesh.build(dp=2, pp=2, tp=1, device="cpu", order=order)
        out[order] = (mesh.coords, tuple(dist.get_process_group_ranks(mesh.pp_group)))
    return out


@pytest.mark.slow
def test_gloo_mesh_follows_the_order() -> None:
    """Four real processes: every process's coordinates and pipeline group are the pure mesh's."""
    from _queue_spawn import fork_launch

    orders = ("tp-dp-pp", "tp-pp-dp")
    results = fork_launch(_gloo_coords, 4, (orders,), timeout_s=120)
    for rank, got in enumerate(results):
        for order in orders:
            layout = Mesh(tp=1, pp=2, dp=2, order=order)
            c = layout.coords(rank)
            assert got[order] == ((c.dp, c.pp, c.tp), layout.group("pp", rank))
