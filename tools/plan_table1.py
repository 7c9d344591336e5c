"""The planner against Megatron-LM Table 1: for each model, the published configuration and the
planner's choice, both simulated on a Selene-like cluster under 80 GB per GPU.

    PYTHONPATH=src python tools/plan_table1.py [--rows 1,2,…] [--json FILE]

The rows are the package's copy of the published table (``cost/data/megatron_table1.csv``).
"""

from __future__ import annotations

import argparse
import time

from _table import markdown_table, report_rows

from pipewright.cost.megatron import packaged_table1
from pipewright.plan.report import make_plan
from pipewright.plan.search import Problem
from pipewright.plan.table1 import table1_setup

LIMIT = 80e9


def compare_row(row) -> dict:
    """Published configuration vs the planner's choice for one Table 1 row."""
    setup = table1_setup(row)
    cost, published = setup.cost, setup.simulate()
    prob = Problem(row.spec(), cost.topology, row.global_batch, dtype="fp16", memory_limit=LIMIT)
    start = time.perf_counter()
    result = make_plan(prob, baselines=False)
    seconds = time.perf_counter() - start
    best = result.best
    return {
        "model": row.name,
        "gpus": row.gpus,
        "published": f"t={row.tp} p={row.pp} d={row.dp} b={row.microbatch} v={row.virtual_chunks} full",
        "published_s": published.iteration_time,
        "published_gib": max(published.peak_memory) / 2**30,
        "plan": best.candidate.describe(),
        "plan_s": best.time,
        "plan_gib": (best.simulated_memory or 0) / 2**30,
        "speedup": published.iteration_time / best.time,
        "planning_s": seconds,
    }


def markdown(rows: list[dict]) -> str:
    header = "model | GPUs | published (full recomputation) | time | memory | plan | time | memory | speedup"
    cells = [
        [
            r["model"],
            r["gpus"],
            r["published"],
            f"{r['published_s']:.2f} s",
            f"{r['published_gib']:.1f} GiB",
            r["plan"],
            f"{r['plan_s']:.2f} s",
            f"{r['plan_gib']:.1f} GiB",
            f"{r['speedup']:.2f}×",
        ]
        for r in rows
    ]
    return markdown_table(header, "lrlrrlrrr", cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="1-based rows to run (default all)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()
    table = packaged_table1()
    pick = [int(x) - 1 for x in args.rows.split(",")] if args.rows else range(len(table))
    report_rows((compare_row(table[i]) for i in pick), markdown, args.json)


if __name__ == "__main__":
    main()
