"""Zero Bubble (Qi et al., ICLR 2024), Tables 3–5: pipewright's predicted ZB-1p/1F1B and ZB-2p/1F1B
throughput ratios for the paper's GPT models, beside the published ratios where given.

Setups as the paper's Table 3 (GPT, sequence 1024, vocabulary 50304, A100 SXM 80 GB, 8 GPUs per node,
pure pipeline parallelism): 1.5B (22 layers, hidden 2304, 24 heads, 8 stages, microbatch 6), 6.2B (30,
4096, 32, 8 stages, microbatch 3), 14.6B (46, 5120, 40, 16 stages, microbatch 1), 28.3B (62, 6144, 48,
32 stages, microbatch 1), each at three microbatch counts. Every schedule is priced by the same
transformer cost model (``pipewright.plan.setup.model_setup``: the embedding on the first stage, the
output layer and loss on the last, each with one transformer layer fewer, as the paper's layer counts
k·p − 2 intend); ZB-1p and ZB-2p are ``zb-auto`` planned with that model's stage
times and transfer time at memory limits p and 2p; the ratio is 1F1B's iteration time over theirs, for
the zero-bubble schedules in steady state without an optimizer barrier (the paper's optimizer
post-validation, §4; three iterations simulated back to back).

    PYTHONPATH=src python tools/zb_paper_tables.py [--published FILE.csv]

``--published``: a CSV with columns model, m, zb1p, zb2p (the paper's ratios to 1F1B; the middle
microbatch count of each model is in ``tests/data/zb_paper_ratios.csv``, from the paper's Table 4) to
set beside the predictions, for those rows only; the difference is printed in points (100 × ratio
difference).
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipewright.mesh import Mesh  # noqa: E402
from pipewright.models.presets import resolve_model  # noqa: E402
from pipewright.plan.setup import cluster_topology, model_setup  # noqa: E402
from pipewright.schedules import build_schedule  # noqa: E402
from pipewright.schedules.schedule_costs import schedule_costs  # noqa: E402
from pipewright.sim import simulate  # noqa: E402

#: name: (layers, hidden, heads, stages, microbatch size, microbatch counts)
MODELS = {
    "1.5B": (22, 2304, 24, 8, 6, (24, 32, 64)),
    "6.2B": (30, 4096, 32, 8, 3, (24, 32, 64)),
    "14.6B": (46, 5120, 40, 16, 1, (48, 64, 128)),
    "28.3B": (62, 6144, 48, 32, 1, (96, 128, 256)),
}


def ratios(name: str, m: int) -> dict[str, float]:
    layers, hidden, heads, p, b, _ = MODELS[name]
    spec = resolve_model("gpt", layers=layers, hidden=hidden, heads=heads, vocab=50304, seq_len=1024)
    topo, gpu = cluster_topology("a100-80gb", max(1, p // 8), min(p, 8), None)
    mesh = Mesh(1, p, 1)

    k = (layers + 2) // p  # the paper's layers = k·p − 2: one layer fewer beside the embedding and the output
    layout = [k - 1] + [k] * (p - 2) + [k - 1]

    def setup(schedule):
        return model_setup(spec, topo, mesh, schedule, b, gpu=gpu, layout=layout)

    probe = setup(build_schedule("1f1b", p, m))
    base = simulate(probe.schedule, probe.cost, comm=probe.comm).iteration_time
    costs = schedule_costs(probe.cost, p, comm=probe.comm)
    out = {"1f1b_s": base}
    for label, limit in (("zb1p", p), ("zb2p", 2 * p)):
        sched = build_schedule("zb-auto", p, m, costs=replace(costs, memory_limit=limit))
        s = setup(sched)
        # post-validation (the paper's §4): no optimizer barrier, so iterations overlap; the steady period
        steady = simulate(s.schedule, s.cost, comm=s.comm, iterations=3, step_barrier=False).iteration_time
        out[label] = base / steady
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", type=Path, default=None)
    args = parser.parse_args(argv)
    published: dict[tuple[str, int], tuple[float, float]] = {}
    if args.published is not None:
        with args.published.open() as fh:
            for row in csv.DictReader(fh):
                published[(row["model"], int(row["m"]))] = (float(row["zb1p"]), float(row["zb2p"]))
    print("| model | p | m | 1F1B s | ZB-1p/1F1B | ZB-2p/1F1B | published 1p / 2p | Δ points 1p / 2p |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (_, _, _, p, _, ms) in MODELS.items():
        for m in ms:
            if published and (name, m) not in published:
                continue  # with --published, only its rows
            r = ratios(name, m)
            pub = published.get((name, m))
            given = f"{pub[0]:.3f} / {pub[1]:.3f}" if pub else "–"
            delta = f"{100 * (r['zb1p'] - pub[0]):+.1f} / {100 * (r['zb2p'] - pub[1]):+.1f}" if pub else "–"
            cells = (name, p, m, f"{r['1f1b_s']:.3f}", f"{r['zb1p']:.3f}", f"{r['zb2p']:.3f}", given, delta)
            print("| " + " | ".join(map(str, cells)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
