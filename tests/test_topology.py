"""Topology: builders, best paths, collective formulas (exact numbers on small graphs), JSON."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.errors import PipewrightError
from pipewright.topology import Edge, Node, Topology, cluster, heterogeneous, ring, single_host, two_tier


def graph(edges, devices=("a", "b", "c", "d"), host="h"):
    return Topology(
        [Node(d, "a100-80gb", host) for d in devices], [Edge(a, b, "x", bw, lat) for a, b, bw, lat in edges]
    )


def test_p2p_is_latency_sum_plus_bytes_over_bottleneck():
    t = graph([("a", "b", 10.0, 1.0), ("b", "c", 5.0, 2.0)])
    assert t.p2p_time("a", "c", 100) == 3.0 + 100 / 5
    assert t.p2p_time(0, 2, 100) == t.p2p_time("c", "a", 100)
    assert t.p2p_time("a", "a", 100) == 0.0


def test_widest_path_then_fewest_hops():
    # direct a–c is narrow; a–b–c is wide; a–b–d–c is as wide but longer
    t = graph(
        [
            ("a", "c", 1.0, 0.0),
            ("a", "b", 8.0, 1.0),
            ("b", "c", 8.0, 1.0),
            ("b", "d", 9.0, 0.0),
            ("d", "c", 9.0, 0.0),
        ]
    )
    p = t.path("a", "c")
    assert (p.bandwidth, p.hops, p.latency) == (8.0, 2, 2.0)


def test_parallel_links_are_bonded():
    t = graph([("a", "b", 10.0, 2.0), ("a", "b", 10.0, 1.0)], devices=("a", "b"))
    assert t.path("a", "b").bandwidth == 20.0 and t.path("a", "b").latency == 1.0


def test_ring_collectives_exact():
    t = graph([("a", "b", 10.0, 1.0), ("b", "c", 10.0, 1.0), ("c", "d", 10.0, 1.0), ("d", "a", 10.0, 1.0)])
    group = ["a", "b", "c", "d"]
    assert t.ring_bandwidth(group) == (10.0, 1.0)
    # ring 2(n-1)/n·S/B + 2(n-1)α = 15 + 6; tree 2·2·(1 + 10) = 44
    assert t.collective_time("all_reduce", group, 100) == pytest.approx(21.0)
    # small message: the tree wins, 2·2·(1 + 0.1)
    assert t.collective_time("all_reduce", group, 1) == pytest.approx(4.4)
    assert t.collective_time("all_gather", group, 100) == pytest.approx(7.5 + 3)
    assert t.collective_time("reduce_scatter", group, 100) == pytest.approx(10.5)
    assert t.collective_time("broadcast", group, 100) == pytest.approx(13.0)
    assert t.collective_time("all_reduce", ["a"], 100) == 0.0
    with pytest.raises(PipewrightError, match="unknown collective 'gather'"):
        t.collective_time("gather", group, 1)


def test_cluster_paths_and_nic_bandwidth():
    t = cluster(2, 4, "a100-80gb")
    assert len(t.devices) == 8 and t.host(4) == "node1"
    inside, across = t.path(0, 1), t.path(0, 4)
    assert (inside.bandwidth, inside.latency, inside.hops) == (300e9, 3e-6, 2)
    assert (across.bandwidth, across.latency, across.hops) == (25e9, 5e-6, 2)
    # four rings in parallel, one per NIC: 4 × 25 GB/s across; NVLink inside
    assert t.ring_bandwidth(range(8))[0] == 100e9
    assert t.ring_bandwidth([0, 4])[0] == 25e9
    # one shared NIC per node: 25 GB/s for the whole node
    shared = cluster(2, 4, "a100-80gb", nics_per_node=1)
    assert shared.ring_bandwidth(range(8))[0] == 25e9
    assert shared.path(0, 4).bandwidth == 25e9 and shared.path(0, 4).hops == 4


def test_other_builders():
    r = ring(4, kind="nvlink3")
    assert r.path(0, 2).hops == 2 and r.path(0, 3).hops == 1
    assert r.ring_bandwidth(range(4)) == (300e9, 3e-6)
    # each device its own host: one ring, each host's egress = its own link
    apart = ring(4, kind="nvlink3", host=None)
    assert apart.ring_bandwidth(range(4)) == (300e9, 3e-6)
    assert apart.collective_time("all_reduce", range(4), 4e9) == pytest.approx(6 / 4 * 4e9 / 300e9 + 6 * 3e-6)
    local = single_host(3)
    assert local.p2p_time(0, 1, 1.8e9) == pytest.approx(1.0 + 2e-4)
    tt = two_tier(2, 2, 2, spines=2, uplinks_per_spine=1)
    assert len(tt.devices) == 8
    # across leaves: GPU → leaf → spine → leaf → GPU
    assert tt.path(0, 7).hops == 4 and tt.path(0, 2).hops == 2
    mixed = heterogeneous([(1, 2, "a100-80gb"), (1, 4, "h100-sxm")])
    assert [mixed.accelerator(i).name for i in (0, 2)] == ["a100-80gb", "h100-sxm"]
    assert mixed.path(2, 3).bandwidth == 450e9
    with pytest.raises(PipewrightError, match="cpu has no NVLink"):
        cluster(1, 2, "cpu")


def test_disconnected_device_is_named():
    t = graph([("a", "b", 1.0, 0.0)], devices=("a", "b", "lonely"))
    with pytest.raises(PipewrightError) as err:
        t.p2p_time("a", "lonely", 1)
    assert "'lonely'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PipewrightError, match="'lonely' is not connected"):
        t.check_connected()
    with pytest.raises(PipewrightError, match="no device 7"):
        t.device(7)


def test_json_round_trip(tmp_path):
    t = cluster(2, 2, "h100-sxm", nics_per_node=1)
    path = tmp_path / "topo.json"
    t.save(path)
    back = Topology.load(path)
    assert back == t and back.devices == t.devices
    assert back.p2p_time(0, 3, 1e6) == t.p2p_time(0, 3, 1e6)


def test_json_defaults_from_catalogue_and_errors(tmp_path):
    data = {
        "format": "pipewright-topology",
        "nodes": [{"name": "x", "accelerator": "v100"}, {"name": "y", "accelerator": "v100"}],
        "links": [{"a": "x", "b": "y", "kind": "pcie3"}],
    }
    t = Topology.from_json(data)
    assert t.path("x", "y").bandwidth == 15.75e9
    bad = dict(data, links=[{"a": "x", "b": "z", "kind": "pcie3"}])
    with pytest.raises(PipewrightError, match="unknown node 'z'"):
        Topology.from_json(bad)
    with pytest.raises(PipewrightError, match="unknown link kind 'pcie9'"):
        Topology.from_json(dict(data, links=[{"a": "x", "b": "y", "kind": "pcie9"}]))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PipewrightError, match="not valid JSON"):
        Topology.load(tmp_path / "bad.json")


names = st.text("abcdefgh/0123", min_size=1, max_size=6)
positive = st.floats(min_value=1e-3, max_value=1e12, allow_nan=False, allow_infinity=False)


@st.composite
def topologies(draw):
    devices = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    switches = [s for s in draw(st.lists(names, max_size=3, unique=True)) if s not in devices]
    hosts = st.one_of(st.none(), st.sampled_from(["h0", "h1"]))
    nodes = [Node(d, draw(st.sampled_from(["a100-80gb", "cpu", "v100"])), draw(hosts)) for d in devices]
    nodes += [Node(s, None, draw(hosts)) for s in switches]
    all_names = devices + switches
    edges = []
    for _ in range(draw(st.integers(0, 8))):
        a, b = draw(st.sampled_from(all_names)), draw(st.sampled_from(all_names))
        if a != b:
            edges.append(
                Edge(a, b, draw(st.sampled_from(["ib-hdr", "custom"])), draw(positive), draw(positive))
            )
    return Topology(nodes, edges, draw(names))


@settings(max_examples=60, deadline=None)
@given(topologies())
def test_json_round_trip_property(t):
    back = Topology.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t
    assert back.devices == t.devices
    for d in t.devices:
        try:
            expected = t.path(t.devices[0], d)
        except PipewrightError:
            with pytest.raises(PipewrightError):
                back.path(back.devices[0], d)
        else:
            assert back.path(back.devices[0], d) == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(
    st.fixed_dictionaries(
        {"format": st.just("pipewright-topology")},
        optional={"nodes": json_values, "links": json_values, "name": json_values},
    )
)
def test_parser_only_raises_pipewright_errors(data):
    try:
        Topology.from_json(data)
    except PipewrightError as exc:
        assert "\n" not in str(exc)
