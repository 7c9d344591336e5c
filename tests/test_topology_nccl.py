"""NCCL's collective model (topology/nccl.py): exact times on small clusters, the algorithm and protocol
it picks, which topologies use it, the JSON field."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.errors import PipewrightError
from pipewright.topology import Edge, Node, Topology, cluster, ring, single_host

US = 1e-6


@pytest.fixture(scope="module")
def two_by_two():
    """2 hosts × 2 A100s: NVLink inside, one HDR NIC per GPU; two rings in parallel, B = 50 GB/s."""
    t = cluster(2, 2, "a100-80gb")
    assert t.collectives == "nccl" and t.ring_bandwidth(range(4))[0] == 50e9
    return t


def test_ring_all_gather_and_reduce_scatter_exact(two_by_two):
    g = two_by_two.nccl_group(range(4))
    assert (g.ranks, g.hosts, g.intra, g.ll128) == (4, 2, "nvlink", True)
    b = 50e9
    for kind in ("all_gather", "reduce_scatter"):
        # 3 steps, 1 across hosts; an NVLink step costs at least the network post overhead (1 µs, 3 Simple)
        # 1 KB: LL, 6.6 + 2·1.0 + 2.7 µs at B/4 · 4/3
        assert two_by_two.collective_time(kind, range(4), 1e3) == pytest.approx(
            11.3 * US + 1e3 / (b / 4 * 4 / 3)
        )
        # 1 MB: LL128, 14 + 2·1.9 + 4.0 µs at 0.92·B · 4/3
        assert two_by_two.collective_time(kind, range(4), 1e6) == pytest.approx(
            21.8 * US + 1e6 / (0.92 * b * 4 / 3)
        )
        # 1 GB: Simple, 8.4 + 2·3.4 + 14 µs at B · 4/3
        assert two_by_two.collective_time(kind, range(4), 1e9) == pytest.approx(29.2 * US + 1e9 / (b * 4 / 3))


def test_all_reduce_tree_for_small_ring_for_large(two_by_two):
    b = 50e9
    # 1 KB: tree LL, 6.8 + 2·(0.6 + 5.0) µs at 0.92·B/3.8 · 1/2 (correction 1.0), beats ring LL (19.4 µs)
    assert two_by_two.collective_time("all_reduce", range(4), 1e3) == pytest.approx(
        18.0 * US + 1e3 / (0.92 * b / 3.8 * 0.5)
    )
    # 1 GB: ring Simple, (8.4 + 2·3.4 + 4·14 µs) × 1.4 (the multi-host plateau) at B · 4/6
    assert two_by_two.collective_time("all_reduce", range(4), 1e9) == pytest.approx(
        71.2 * 1.4 * US + 1e9 / (b * 4 / 6)
    )


def test_broadcast_is_a_chain_of_hops(two_by_two):
    # 4 network hops: LL 6.6 + 4·2.7 µs at B/4; Simple 8.4 + 4·14 µs at B
    assert two_by_two.collective_time("broadcast", range(4), 1e3) == pytest.approx(17.4 * US + 1e3 / 12.5e9)
    assert two_by_two.collective_time("broadcast", range(4), 1e9) == pytest.approx(64.4 * US + 1e9 / 50e9)


def test_one_gpu_per_host_and_pcie_hosts():
    apart = cluster(4, 1, "a100-80gb")
    g = apart.nccl_group(range(4))
    assert (g.hosts, g.intra, g.ll128, g.bandwidth) == (4, "pci", True, 25e9)
    # every step crosses hosts; LL128 at 0.7·B with one GPU per host: 14 + 3·4.0 µs
    assert apart.collective_time("reduce_scatter", range(4), 1e6) == pytest.approx(
        26.0 * US + 1e6 / (0.7 * 25e9 * 4 / 3)
    )
    pcie = cluster(1, 4, "a100-80gb", intra="pcie4")
    g = pcie.nccl_group(range(4))
    assert (g.hosts, g.intra, g.ll128) == (1, "pci", False)
    # no LL128 without NVLink (it would take 47.4 µs): Simple, 8.4 + 3·5.7 µs at B · 4/3
    assert pcie.collective_time("all_gather", range(4), 1e6) == pytest.approx(
        25.5 * US + 1e6 / (31.5e9 * 4 / 3)
    )


def test_ring_latency_at_many_hosts():
    """192 hosts, one rank each (a data-parallel group under TP 8): 191 network steps of 14 µs
    (Simple) where the α–β ring charges the 5 µs path latency."""
    t = cluster(192, 1, "a100-80gb")
    group = range(192)
    nbytes = 1e9
    simple = (8.4 + 191 * 14.0) * US + nbytes / (25e9 * 192 / 191)
    assert t.collective_time("reduce_scatter", group, nbytes) == pytest.approx(simple)
    assert t._alpha_beta("reduce_scatter", group, nbytes) == pytest.approx(
        191 / 192 * nbytes / 25e9 + 191 * 5e-6
    )


def test_which_topologies_use_it(tmp_path):
    assert cluster(1, 2, "h100-sxm").collectives == "nccl"
    assert single_host(2).collectives == "alpha-beta" and ring(3).collectives == "alpha-beta"
    hand = Topology([Node("a", "a100-80gb"), Node("b", "a100-80gb")], [Edge("a", "b", "x", 1.0, 1.0)])
    assert hand.collectives == "alpha-beta"
    path = tmp_path / "t.json"
    cluster(2, 2, "a100-80gb").save(path)
    back = Topology.load(path)
    assert back.collectives == "nccl" and back.collective_time("all_reduce", range(4), 1e3) == pytest.approx(
        18.0 * US + 1e3 / (0.92 * 50e9 / 3.8 * 0.5)
    )
    data = hand.to_json() | {"collectives": "mpi"}
    with pytest.raises(PipewrightError, match="collectives must be one of alpha-beta, nccl") as err:
        Topology.from_json(data)
    assert "\n" not in str(err.value)
    with pytest.raises(PipewrightError, match='"collectives" must be a string'):
        Topology.from_json(hand.to_json() | {"collectives": 3})


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast"]), st.floats(1, 1e10))
def test_time_grows_with_bytes(kind, nbytes):
    t = cluster(2, 2, "a100-80gb")
    assert t.collective_time(kind, range(4), nbytes) <= t.collective_time(kind, range(4), nbytes * 1.5)
