"""Reference makespans of the Zero Bubble authors' schedulers, scored by pipewright's simulator.

Runs the schedulers of sail-sg/zero-bubble-pipeline-parallelism (``zb.py``: the automatic schedule at
memory limits p and 2p, the reference code's ZB-1p and ZB-2p; ``zbv.py``: the cost-aware ZB-V greedy;
``zbv_greedy.py``: V-Half and V-Min with the squeeze) on the test grid — p ∈ {4, 8}, m ∈ {8, 16,
24}, per-stage F:I:W = 1:1:1 and 2:2:1, transfer time 0 and 0.5 — with pipewright's memory convention
(F adds one stage-microbatch, I nothing, W frees it), turns each order into a pipewright ``Schedule``
and writes its simulated makespan and peak (``pipewright.ir.peak_in_flight``, the largest rank's, in
microbatches of a rank's layers) to ``tests/data/zb_reference.csv``, which ``tests/test_zb_reference.py``
and ``tools/gen_schedule_docs.py`` read.

The authors' code is not part of pipewright: copy its scheduler directory
(``megatron/core/pipeline_parallel/zerobubble/scheduler``: graph.py, zb.py, zbv.py, zbv_greedy.py) to a
scratch directory and give it as ``--ref``; the imports of megatron, torch and pulp there are stubbed.

    PYTHONPATH=src python tools/zb_reference.py --ref /tmp/zbref
"""

from __future__ import annotations

import argparse
import csv
import importlib
import itertools
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipewright.cost import UnitCost  # noqa: E402
from pipewright.ir import Action, Schedule, loop_placement, peak_in_flight, v_placement  # noqa: E402
from pipewright.sim import simulate  # noqa: E402

GRID = list(itertools.product((4, 8), (8, 16, 24), ((1, 1, 1), (2, 2, 1)), (0.0, 0.5)))
OUT = ROOT / "tests" / "data" / "zb_reference.csv"
FIELDS = ("p", "m", "f", "i", "w", "comm", "reference", "makespan", "peak")


class ConstComm:
    """Every point-to-point transfer takes ``p2p``."""

    def __init__(self, p2p: float) -> None:
        self.p2p = p2p

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return self.p2p

    def collective_time(self, kind: str, rank: int, nbytes: float, group: str = "dp", members=()) -> float:
        return 0.0


def score(sched: Schedule, fiw: tuple[float, float, float], comm: float) -> tuple[float, float]:
    """pipewright's simulated makespan and largest per-rank peak of ``sched``."""
    f, i, w = fiw
    res = simulate(sched, UnitCost(times={"F": f, "I": i, "W": w, "B": i + w}), comm=ConstComm(comm))
    return res.iteration_time, float(max(peak_in_flight(sched)))


def _load(ref: Path) -> types.SimpleNamespace:
    """Import the authors' modules from ``ref`` with their package imports redirected."""
    sys.modules.setdefault("pulp", types.ModuleType("pulp"))
    if "torch" not in sys.modules:
        sys.modules["torch"] = types.SimpleNamespace(Tensor=object)  # zb.py uses it as an annotation only
    pkg = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    sys.path.insert(0, str(ref))
    graph = importlib.import_module("graph")
    for name in (
        "megatron",
        "megatron.core",
        "megatron.core.pipeline_parallel",
        "megatron.core.pipeline_parallel.zerobubble",
        pkg,
    ):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[f"{pkg}.graph"] = graph
    return types.SimpleNamespace(
        graph=graph, **{n: importlib.import_module(n) for n in ("zb", "zbv", "zbv_greedy")}
    )


def _zb(mod, p: int, m: int, fiw, comm: float, limit: int) -> list[list[Action]]:
    f, i, w = map(float, fiw)
    cfg = mod.graph.GraphConfig(
        cost_f=[f] * p,
        cost_b=[i] * p,
        cost_w=[w] * p,
        cost_comm=float(comm),
        mem_f=[1] * p,
        mem_b=[0] * p,
        mem_w=[-1] * p,
        max_mem=[limit] * p,
        n_stages=p,
        n_micro=m,
    )
    g = mod.zb.Graph.build_graph(p, m, cfg)
    _, _, end = mod.zb.initial_solution(g, print_result=False)
    kinds = "FIW"
    return [
        [
            Action(s, kinds[k], mb)
            for _, k, mb in sorted((end[g.get_id(k, s, mb)], k, mb) for k in range(3) for mb in range(m))
        ]
        for s in range(p)
    ]


def _v_rows(p: int, orders, leg_of) -> list[list[Action]]:
    """Per rank (category, index, microbatch) → Actions; ``leg_of(cat, index)`` is 0 for stage r."""
    return [
        [Action((r, 2 * p - 1 - r)[leg_of(cat, ix)], "FIW"[cat], mb) for cat, ix, mb in orders[r]]
        for r in range(p)
    ]


def _zbv(mod, p: int, m: int, fiw, comm: float) -> list[list[Action]]:
    g = mod.zbv.PipelineGraph(p, m, *fiw, comm, f_mem=1, b_mem=0, w_mem=-1, max_mem=None)
    runs = [g.try_v_schedule(fill_b=b, fill_f=f) for b in (True, False) for f in (True, False)]
    best = min(runs, key=lambda run: run[2])[0]  # the authors' choice: least largest bubble, first
    # their backward and W index 0 is the second leg (stage 2p − 1 − r)
    return _v_rows(p, best, lambda cat, ix: ix if cat == 0 else 1 - ix)


def _vgreedy(mod, p: int, m: int, fiw, comm: float, which: str) -> list[list[Action]]:
    g = mod.zbv_greedy.PipelineGraph(p, m, which, *fiw, comm)
    pattern = {"min": g.stable_pattern_v_min, "half": g.stable_pattern_v_half}[which](p)
    _, _, orders = g.schedule_from_pattern(pattern, m, [fiw[x // 2] for x in range(6)], do_reorder=True)
    rows = [[(t // 2, t % 2, mb) for t, mb in row] for row in orders]
    return _v_rows(p, rows, lambda cat, ix: ix if cat == 0 else 1 - ix)


def reference_rows(ref: Path) -> list[dict[str, object]]:
    mod = _load(ref)
    rows = []
    for p, m, fiw, comm in GRID:
        orders = {
            "zb-1p": (_zb(mod, p, m, fiw, comm, p), loop_placement(p)),
            "zb-2p": (_zb(mod, p, m, fiw, comm, 2 * p), loop_placement(p)),
            "zbv": (_zbv(mod, p, m, fiw, comm), v_placement(p)),
            "v-half": (_vgreedy(mod, p, m, fiw, comm, "half"), v_placement(p)),
            "v-min": (_vgreedy(mod, p, m, fiw, comm, "min"), v_placement(p)),
        }
        for name, (actions, placement) in orders.items():
            makespan, peak = score(Schedule.build(f"ref-{name}", m, actions, placement), fiw, comm)
            rows.append(dict(zip(FIELDS, (p, m, *fiw, comm, name, makespan, peak), strict=True)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ref", required=True, type=Path, help="directory holding the authors' scheduler files"
    )
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows = reference_rows(args.ref)
    with args.output.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def ours(name: str, row: dict[str, str], limit: int | None = None) -> tuple[float, float]:
    """pipewright's ``name`` on the setting of a CSV row, built with those costs (and ``limit``
    microbatches in flight where given): simulated makespan and largest peak."""
    from pipewright.schedules import ScheduleCosts, build_schedule

    p, m, comm = int(row["p"]), int(row["m"]), float(row["comm"])
    fiw = (float(row["f"]), float(row["i"]), float(row["w"]))
    n = 2 * p if name in ("zbv", "v-half", "v-min") else p
    costs = ScheduleCosts(*((x,) * n for x in fiw), comm, limit)
    return score(build_schedule(name, p, m, costs=costs), fiw, comm)


#: the reference each of our schedules is held to and the memory limit it is built with ("p", "2p")
HELD_TO = {
    "zb-1p": (("zb-auto", "p"), ("zb-h1", None)),
    "zb-2p": (("zb-auto", "2p"), ("zb-h2", None)),
    "zbv": (("zbv", None),),
    "v-half": (("v-half", None),),
    "v-min": (("v-min", None),),
}


def markdown_table(path: Path = OUT) -> str:
    """The reference's makespan and peak beside ours for every row of ``path``."""
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    lines = [
        "| p | m | F:I:W | comm | reference | its makespan / peak | pipewright | makespan / peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = int(row["p"])
        for name, limit in HELD_TO[row["reference"]]:
            t, peak = ours(name, row, {None: None, "p": p, "2p": 2 * p}[limit])
            label = name + (f" (limit {limit})" if limit else "")
            fiw = f"{float(row['f']):g}:{float(row['i']):g}:{float(row['w']):g}"
            lines.append(
                f"| {p} | {row['m']} | {fiw} | {float(row['comm']):g} | {row['reference']} | "
                f"{float(row['makespan']):g} / {float(row['peak']):g} | {label} | {t:g} / {peak:g} |"
            )
    return "\n".join(lines)
