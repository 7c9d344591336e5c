"""PipeFisher's own plan period ("iterations per refresh") on pipewright's simulated timelines, beside
pipewright's definitions: the K-FAC refresh table of docs/pipefisher.md.

For BERT-Large on V100 (microbatch 32, one block per stage, D = p microbatches, the shared PipeFisher
profiles), each schedule is simulated once; every rank's F, B (I) and W spans become a timeline in the
format of PipeFisher's profiler (integer nanoseconds; W under a ``call_backward:w`` key, so it is busy
time but not a backward PipeFisher counts), its K-FAC tasks are the ones pipewright fills with
(curvature A and B per layer as queues of D pieces, one reduction per factor taking the collective's
time, one inversion per factor), and PipeFisher's ``auto_schedule.main`` plans them. The table gives
its plan period (max over ranks) next to pipewright's steady state, first refresh and its own
implementation of PipeFisher's rule (:mod:`pipewright.features.kfac.pipefisher_plan`).

PipeFisher's code is not part of pipewright: copy ``auto_schedule.py`` of kazukiosawa/pipe-fisher to a
scratch directory and give that directory as ``--ref``.

    PYTHONPATH=src python tools/pipefisher_reference.py --ref /tmp/pf
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipewright.features.kfac.utilization import Row, fill_profiled, markdown, paper_model  # noqa: E402
from pipewright.ir import B, F, I, W  # noqa: E402
from pipewright.sim.engine import simulate  # noqa: E402

ROWS = (
    ("gpipe", 4),
    ("1f1b", 4),
    ("gpipe", 8),
    ("1f1b", 8),
    ("gpipe", 16),
    ("1f1b", 16),
    ("zb-h1", 4),
    ("zb-h1", 8),
    ("zbv", 4),
)
KEYS = {F: "call_forward", B: "call_backward", I: "call_backward", W: "call_backward:w"}
TASKS = (
    ("cov_kron_A", 0),
    ("cov_kron_B", 1),
    ("sync_kron_A", 0),
    ("sync_kron_B", 1),
    ("inv_kron_A", 0),
    ("inv_kron_B", 1),
)
NS = 1e9  # seconds → integer nanoseconds


def timelines(result) -> list[dict[str, list[tuple[int, int]]]]:
    """Per rank, PipeFisher's profiler format for ``result``'s plain schedule and K-FAC tasks."""
    sim = simulate(result.base, result.cost, comm=result.comm)
    times, base, m = result.cost.times, result.base, result.base.num_microbatches
    out = []
    for r in range(base.num_ranks):
        tl: dict[str, list[tuple[int, int]]] = {key: [] for key in KEYS.values()}
        for a, s, e in sim.spans_of(r):
            if a.kind in KEYS:
                tl[KEYS[a.kind]].append((round(s * NS), round(e * NS)))
        order = 0  # distinct start stamps keep PipeFisher's layer order within a priority
        for label, idx in TASKS:
            for s in base.stages_of(r):
                for layer in range(times.layers(s)):
                    if label.startswith("cov"):
                        d = round(times.curv[s][layer][idx] * NS) * m
                    elif label.startswith("sync"):
                        nbytes = times.factor_bytes(s, layer, label[-1])
                        d = round(result.comm.collective_time("all_reduce", r, nbytes) * NS)
                    else:
                        d = round(times.inv[s][layer][idx] * NS)
                    tl[f"{label}:s{s}l{layer}"] = [(order, order + d)]
                    order += 1
        out.append(tl)
    return out


def pipefisher_period(module: types.ModuleType, result) -> int:
    module.timelines = timelines(result)
    module.args = types.SimpleNamespace(print_workloads=False, save_path=None)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        module.main()
    return max(int(x) for x in re.findall(r"node\d+:(\d+) pipeline iterations", buf.getvalue()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ref", required=True, type=Path, help="directory holding PipeFisher's auto_schedule.py"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.ref))
    module = importlib.import_module("auto_schedule")
    rows, reference = [], {}
    for name, d in ROWS:
        res = fill_profiled(name, "bert-large", "v100", 32, d)
        model = paper_model("bert-large", "v100", 32, d) if name in ("gpipe", "1f1b") else None
        rows.append(Row(name, d, model, res))
        reference[(name, d)] = pipefisher_period(module, res)
    print(markdown(rows, reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
