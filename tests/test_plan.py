"""The planner: partition optimality, Korthikanti's activation formulas, mapping on graphs, exhaustive
search on small heterogeneous instances, plan files and one-line errors."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pipewright.cli import main
from pipewright.cost.comm import Mesh
from pipewright.cost.recompute import activation_bytes_per_layer, make_cost
from pipewright.errors import ConfigError
from pipewright.ir import Action, B, F
from pipewright.models.presets import resolve_model
from pipewright.models.spec import ModelSpec
from pipewright.plan.mapping import DisconnectedTopologyError, device_order
from pipewright.plan.partition import (
    DoesNotFitError,
    StageTerms,
    bisect_partition,
    dp_partition,
    layout_string,
)
from pipewright.plan.search import Candidate, Evaluated, Problem, search, simulate_plan
from pipewright.schedules import build_schedule
from pipewright.topology import Edge, Node, Topology, ring

GPT = ModelSpec("t", 8, 1024, 16, 32000, 2048)


def test_dp_and_bisection_find_the_same_bottleneck():
    rng = random.Random(7)
    for _ in range(150):
        p = rng.randint(1, 6)
        L = rng.randint(p, 16)
        terms = [
            StageTerms(
                rng.uniform(0.5, 2), rng.uniform(0, 3), 1, 0, 1, 0, rng.randint(1, 4), rng.uniform(5, 40)
            )
            for _ in range(p)
        ]
        try:
            a = dp_partition(terms, L)
        except DoesNotFitError:
            with pytest.raises(DoesNotFitError):
                bisect_partition(terms, L)
            continue
        b = bisect_partition(terms, L)
        assert b.bottleneck == pytest.approx(a.bottleneck, rel=1e-6)
        # the DP is exact: no composition has a smaller bottleneck
        brute = min(
            max(t.time(n) for t, n in zip(terms, comp, strict=True))
            for comp in _compositions(L, p)
            if all(t.memory(n) <= t.memory_limit for t, n in zip(terms, comp, strict=True))
        )
        assert a.bottleneck == pytest.approx(brute, rel=1e-12)


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


@pytest.mark.parametrize(
    ("t", "sp", "recompute", "per_sbh"),
    [
        (1, False, "none", lambda a, s, h, t: 34 + 5 * a * s / h),
        (8, False, "none", lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t)),
        (8, True, "none", lambda a, s, h, t: 34 / t + 5 * a * s / (h * t)),
        (8, False, "selective", lambda a, s, h, t: 10 + 24 / t),
        (8, True, "selective", lambda a, s, h, t: 34 / t),
        (8, False, "full", lambda a, s, h, t: 2),
    ],
)
def test_activation_memory_formulas_of_korthikanti(t, sp, recompute, per_sbh):
    spec = resolve_model("gpt3-175b")
    s, h, a, b = spec.seq_len, spec.hidden, spec.heads, 1
    expected = s * b * h * per_sbh(a, s, h, t)
    assert activation_bytes_per_layer(spec, b, t, sp, recompute) == pytest.approx(expected, rel=1e-12)
    # the cost model stores exactly that per layer in F (16-bit activations), middle stage
    layers = (1, 2, 1)
    cost = make_cost(recompute, spec=spec, microbatch=b, mesh=Mesh(t, 3, 1), sequence_parallel=sp,
                     layout=(*layers[:1], 94, layers[2]))  # fmt: skip
    sched = build_schedule("1f1b", 3, 4)
    mid = cost.activation_bytes(Action(1, F, 0), sched)
    if recompute != "full" or sp:
        assert mid == pytest.approx(94 * expected, rel=1e-12)
    else:
        assert mid == pytest.approx(94 * 2 * s * b * h, rel=1e-12)
    assert cost.activation_bytes(Action(1, B, 0), sched) == pytest.approx(-mid)


def test_selective_recomputation_reruns_only_the_attention_core():
    spec = resolve_model("gpt3-175b")
    sched = build_schedule("1f1b", 2, 2)
    kw = dict(spec=spec, microbatch=1, mesh=Mesh(8, 2, 1), layout=(48, 48))
    none, sel, full = (make_cost(r, **kw) for r in ("none", "selective", "full"))
    s, h = spec.seq_len, spec.hidden
    extra = sel.flops(Action(0, B, 0), sched) - none.flops(Action(0, B, 0), sched)
    assert extra == pytest.approx(48 * 4 * s * s * h / 8, rel=1e-12)
    assert none.flops(Action(0, F, 0), sched) == sel.flops(Action(0, F, 0), sched)
    t_none, t_sel, t_full = (c.compute_time(Action(0, B, 0), sched) for c in (none, sel, full))
    assert t_none < t_sel < t_full


def _hetero4() -> Topology:
    """Four devices on two hosts: a fast pair, a slow pair (PCIe), host link over 25G Ethernet, and one
    slower GPU kind."""
    nodes = [Node("a0", "a100-80gb", "A"), Node("a1", "a100-80gb", "A"), Node("b0", "a100-80gb", "B"),
             Node("b1", "v100", "B")]  # fmt: skip
    edges = [Edge("a0", "a1", "nvlink3", 300e9, 3e-6), Edge("b0", "b1", "pcie4", 31.5e9, 5e-6),
             Edge("a1", "b0", "eth-25g", 3.125e9, 15e-6)]  # fmt: skip
    return Topology(nodes, edges, "hetero4")


def test_plan_is_within_two_percent_of_exhaustive_search():
    """≤ 8 devices, ≤ 16 layers, heterogeneous links and GPUs: every partition × every device order."""
    topo = _hetero4()
    spec = ModelSpec("small", 8, 1024, 16, 32000, 1024)
    prob = Problem(spec, topo, 8, dtype="fp16", schedules=("1f1b",), recompute=("none",),
                   microbatch_sizes=(1,), fixed=(1, 4, 1))  # fmt: skip
    plan = search(prob).best
    c = Candidate(1, 4, 1, 1, 8, "1f1b", 1, "none", False, "pp")
    best = float("inf")
    for perm in itertools.permutations(topo.devices):
        for comp in _compositions(8, 4):
            ev = simulate_plan(prob, Evaluated(c, comp, perm, 0.0, 0.0))
            if ev.fits:
                best = min(best, ev.time)
    assert plan.candidate.pp == 4
    assert plan.time <= best * 1.02


def test_device_order_follows_a_ring_and_keeps_hosts_together():
    assert device_order(ring(6)) in (tuple(f"d{i}" for i in range(6)),
                                     ("d0", *(f"d{i}" for i in range(5, 0, -1))))  # fmt: skip
    order = device_order(_hetero4())
    assert {order[0], order[1]} == {"a0", "a1"} or {order[2], order[3]} == {"a0", "a1"}


def test_disconnected_topology_is_a_one_line_error():
    topo = Topology([Node("x", "a100-80gb", "h"), Node("y", "a100-80gb", "g")], [], "split")
    with pytest.raises(DisconnectedTopologyError, match="not connected: device 'y'"):
        device_order(topo)


def test_model_that_fits_nowhere(capsys):
    rc = main(["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--nodes", "1", "--gpus-per-node", "2",
               "--global-batch-size", "8", "--no-baselines"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "fits nowhere" in err and len(err.strip().splitlines()) == 1


def test_plan_file_round_trip_and_other_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    topo = tmp_path / "topo.json"
    _hetero4().save(topo)
    argv = ["plan", "--model", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--vocab", "32000", "--seq-len", "1024", "--topology", str(topo),
            "--global-batch-size", "8", "--dtype", "fp16", "--dp", "1", "--no-progress",
            "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "baselines" in text and "megatron" in text
    data = json.loads(out.read_text())
    assert data["format"] == "pipewright-plan" and len(data["devices"]) == 4
    from pipewright.models.layout import parse_layout

    assert parse_layout(data["layout"]).num_layers == 8
    assert main(["simulate", "--plan", str(out), "--topology", str(topo), "--dtype", "fp16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert data["dp"] == 1  # (simulate adds no gradient all-reduce; the planner does)
    assert report["iteration_time_s"] == pytest.approx(data["predicted"]["iteration_time_s"], rel=1e-9)
    rc = main(["simulate", "--plan", str(out), "--topology", str(topo), "--model", "gpt", "--layers", "12",
               "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--seq-len", "1024"])  # fmt: skip
    assert rc == 2
    assert "plan was made for model" in capsys.readouterr().err


def test_layout_string_is_what_the_parser_reads():
    from pipewright.models.layout import parse_layout

    text = layout_string((3, 1, 4, 2))
    assert text == "Et*3|t|t*4|t*2L"
    assert [len(s.layers) for s in parse_layout(text).stages] == [3, 1, 4, 2]


@pytest.mark.slow
def test_megatron_table1_small_rows_are_beaten_under_80gb(monkeypatch):
    """Megatron-LM Table 1 (the package's copy): the plan is at least as fast as the published
    configuration, both simulated, under 80 GB (rows 1–2 here; all ten in tools/plan_table1.py)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(root / "tools")  # the tool imports its sibling tools/_table.py
    spec = importlib.util.spec_from_file_location("plan_table1", root / "tools" / "plan_table1.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    table = tool.packaged_table1()
    for row in table[:2]:
        result = tool.compare_row(row)
        assert result["plan_s"] <= result["published_s"]
        assert result["plan_gib"] * 2**30 <= tool.LIMIT


def test_train_plan_values_and_other_model(tmp_path):
    from pipewright.errors import ConfigError
    from pipewright.plan.planfile import FORMAT, model_json, save
    from pipewright.training.plan_values import plan_values

    spec = resolve_model("gpt-small-cpu", layers=8)
    data = {"format": FORMAT, "model": model_json(spec), "tp": 1, "pp": 4, "dp": 1, "virtual": 1,
            "schedule": "1f1b", "microbatches": 16, "microbatch_size": 1, "sequence_parallel": False,
            "layout": "Et*3|t*2|t*2|tL", "devices": []}  # fmt: skip
    path = tmp_path / "plan.json"
    save(data, path)
    out = plan_values(str(path), {("model", "model"): None, ("model", "layers"): None})
    p, m = "parallelism", "model"
    assert (out[p, "pp"], out[p, "layout"], out[m, "layers"], out[m, "model"]) == (
        4,
        "Et*3|t*2|t*2|tL",
        8,
        "gpt-small-cpu",
    )
    with pytest.raises(ConfigError, match="made for a model with layers 8, not 12"):
        plan_values(str(path), {("model", "layers"): 12})
    with pytest.raises(ConfigError, match="not a plan file"):
        (tmp_path / "bad.json").write_text("{}")
        plan_values(str(tmp_path / "bad.json"))


def test_per_stage_recomputation_takes_each_stage_from_its_mode():
    spec = resolve_model("gpt3-175b")
    sched = build_schedule("1f1b", 2, 4)
    kw = dict(spec=spec, microbatch=1, mesh=Mesh(8, 2, 1), layout=(48, 48), sequence_parallel=True)
    mixed = make_cost(per_stage=("selective", "none"), **kw)
    sel, none = make_cost("selective", **kw), make_cost("none", **kw)
    for kind in (F, B):
        assert mixed.compute_time(Action(0, kind, 0), sched) == sel.compute_time(Action(0, kind, 0), sched)
        assert mixed.compute_time(Action(1, kind, 0), sched) == none.compute_time(Action(1, kind, 0), sched)
        assert mixed.activation_bytes(Action(1, kind, 0), sched) == none.activation_bytes(
            Action(1, kind, 0), sched
        )
    with pytest.raises(ConfigError, match="--recompute must be one of"):
        make_cost(per_stage=("some", "none"), **kw)
