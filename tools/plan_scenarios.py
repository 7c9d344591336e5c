"""The planner against its baselines on heterogeneous topologies (the table in docs/planner.md).

    PYTHONPATH=src python tools/plan_scenarios.py [--json FILE]

Scenarios (16 GPUs each unless stated; GPT-3 13B, global batch 64, sequence 2048):
mixed links (two machines on InfiniBand HDR, two on 25 GbE), one slow node (three A100 machines and one
V100 machine), a ring of 8 A100s over PCIe 4 links only, a two-tier oversubscribed fabric (two leaves,
one 200 Gb/s uplink each) and a mix of GPU kinds (two A100 machines, two H100 machines).
"""

from __future__ import annotations

import argparse
import time

from _table import markdown_table, report_rows

from pipewright.models.presets import resolve_model
from pipewright.plan.report import make_plan
from pipewright.plan.search import Problem
from pipewright.topology import Edge, Node, Topology, heterogeneous, ring, two_tier


def mixed_links() -> Topology:
    """Four machines of 4 A100s: machines 0, 1 with NVLink inside and one HDR port per GPU, machines
    2, 3 with PCIe 4 inside and one 25 GbE port per machine."""
    nodes, edges = [Node("fabric")], []
    for i in range(4):
        host = f"node{i}"
        nodes.append(Node(f"{host}/switch", None, host))
        if i >= 2:
            nodes.append(Node(f"{host}/nic", None, host))
            edges.append(Edge(f"{host}/nic", "fabric", "eth-25g", 3.125e9, 7.5e-6))
        for j in range(4):
            dev = f"{host}/gpu{j}"
            nodes.append(Node(dev, "a100-80gb", host))
            if i < 2:
                edges.append(Edge(dev, f"{host}/switch", "nvlink3", 300e9, 1.5e-6))
            else:
                edges.append(Edge(dev, f"{host}/switch", "pcie4", 31.5e9, 2.5e-6))
            if i < 2:
                edges.append(Edge(dev, "fabric", "ib-hdr", 25e9, 2.5e-6))
            else:
                edges.append(Edge(dev, f"{host}/nic", "pcie4", 31.5e9, 2.5e-6))
    return Topology(nodes, edges, "mixed-links-4x4")


MODEL = "gpt3-13b"


def mixed_ring(n: int = 8) -> Topology:
    """n A100s in a ring, each on its own host, the links alternating NVLink 3 and PCIe 4; devices listed
    starting at a PCIe link (d1 – d2 – … – d0), as a job scheduler might hand them out."""
    nodes = [Node(f"d{(i + 1) % n}", "a100-80gb", f"h{(i + 1) % n}") for i in range(n)]
    edges = []
    for i in range(n):
        a, b = f"d{i}", f"d{(i + 1) % n}"
        if i % 2 == 0:
            edges.append(Edge(a, b, "nvlink3", 300e9, 3e-6))
        else:
            edges.append(Edge(a, b, "pcie4", 31.5e9, 5e-6))
    return Topology(nodes, edges, f"mixed-ring{n}")


SCENARIOS = {
    "mixed link speeds": mixed_links,
    "one slow node (V100)": lambda: heterogeneous([(3, 4, "a100-80gb"), (1, 4, "v100")]),
    "ring of 8 (PCIe links)": lambda: ring(8, "a100-80gb", "pcie4", host=None),
    "ring of 8 (NVLink and PCIe links alternating)": mixed_ring,
    "two-tier fabric (oversubscribed)": lambda: two_tier(2, 2, 4, "a100-80gb", spines=1, nics_per_node=1),
    "mixed GPU kinds (A100 + H100)": lambda: heterogeneous([(2, 4, "a100-80gb"), (2, 4, "h100-sxm")]),
}


def run(name: str, topo: Topology) -> dict:
    spec = resolve_model(MODEL)
    kinds = {topo.nodes[d].accelerator for d in topo.devices}
    dtype = "fp16" if "v100" in kinds else "bf16"
    prob = Problem(spec, topo, 64, dtype=dtype)
    start = time.perf_counter()
    result = make_plan(prob)
    seconds = time.perf_counter() - start
    row = {
        "scenario": name,
        "devices": len(topo.devices),
        "plan": result.best.candidate.describe(),
        "plan_s": result.best.time,
        "planning_s": seconds,
    }
    for b in result.baselines:
        if not b.fits:
            continue
        row[b.label] = b.time
        row[f"{b.label}_config"] = b.candidate.describe()
    return row


def markdown(rows: list[dict]) -> str:
    header = "topology | GPUs | plan | plan time | × uniform | × Megatron rules | × PipeDream DP"
    cells = [
        [r["scenario"], r["devices"], r["plan"], f"{r['plan_s']:.3f} s"]
        + [
            f"{r[k] / r['plan_s']:.2f}×" if k in r else "does not fit"
            for k in ("uniform", "megatron", "pipedream")
        ]
        for r in rows
    ]
    return markdown_table(header, "lrlrrrr", cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()
    report_rows((run(name, build()) for name, build in SCENARIOS.items()), markdown, args.json)


if __name__ == "__main__":
    main()
