"""The CPU allocator policy (``--cpu-allocator retain|system``, runtime/setup/host_memory.py), measured two
ways,
the policies alternating round by round in fresh processes:

1. The output layer's passes S + T (``features/vocab/shard.py``) for 256 tokens, h = 64 and a shard of
   16k or 128k vocabulary rows, one thread: median milliseconds per S + T after 3 warm-up iterations,
   the minor page faults per iteration and the process's peak resident memory.
2. ``pipewright train`` with its defaults (gpt-small-cpu, pp = 2, two processes) for ``--steps`` steps,
   timed through the command: wall seconds of the whole command (start-up included) and the run's own
   tokens/s, with ``--cpu-allocator retain`` and ``system``.

    python benchmarks/bench_host_memory.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time

_PASSES = """
import json, resource, statistics, sys, time
from pipewright.runtime.setup.host_memory import use_cpu_allocator
use_cpu_allocator(sys.argv[1])
import torch
from pipewright.features.vocab import shard as vs
torch.set_num_threads(1)
rows = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
n, h = 256, 64
x, w = torch.randn(n, h, generator=g), torch.randn(rows, h, generator=g) * 0.02
labels, dloss = torch.randint(0, rows, (n,), generator=g), torch.full((n,), 1.0 / n)
ms, faults = [], []
for i in range(10):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    s = vs.s_pass(x, w, labels, 0, rows, fused=False)
    vs.t_pass(x, w, labels, 0, rows, s, s.stats, dloss, input_grad=True)
    del s
    ms.append(1e3 * (time.perf_counter() - t0))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps([statistics.median(ms[3:]), statistics.median(faults[3:]), peak]))
"""

POLICIES = ("retain", "system")


def passes(policy: str, rows: int) -> tuple[float, float, float]:
    """(median ms per S + T, median page faults per iteration, peak RSS MiB) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _PASSES, policy, str(rows)], capture_output=True, text=True, check=True
    )
    return tuple(json.loads(out.stdout))


def train(policy: str, steps: int) -> tuple[float, float]:
    """(wall seconds of the whole ``pipewright train`` command, the run's tokens/s)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = ["pipewright", "train", "--steps", str(steps), "--eval-every", "0", "--no-progress"]
        cmd += ["--no-artifacts", "--out", out, "--cpu-allocator", policy]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
    tokens = float(re.search(r"([\d,]+) tokens/s", res.stdout).group(1).replace(",", ""))
    return wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    print("| S + T, rows | policy | ms per round | median ms | page faults / iteration | peak RSS (MiB) |")
    print("|---:|---|---|---:|---:|---:|")
    for rows in (16384, 131072):
        got: dict[str, list[tuple[float, float, float]]] = {p: [] for p in POLICIES}
        for _ in range(args.rounds):
            for policy in POLICIES:
                got[policy].append(passes(policy, rows))
        for policy in POLICIES:
            ms = [r[0] for r in got[policy]]
            faults, peak = statistics.median(r[1] for r in got[policy]), max(r[2] for r in got[policy])
            per_round = " / ".join(f"{m:.0f}" for m in ms)
            med = statistics.median(ms)
            cells = [str(rows), policy, per_round, f"{med:.0f}", f"{faults:.0f}", f"{peak:.0f}"]
            print("| " + " | ".join(cells) + " |")
    print(f"\n| pipewright train --steps {args.steps} | wall s per round | tokens/s per round |")
    print("|---|---|---|")
    runs: dict[str, list[tuple[float, float]]] = {p: [] for p in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            runs[policy].append(train(policy, args.steps))
    for policy in POLICIES:
        walls = " / ".join(f"{w:.1f}" for w, _ in runs[policy])
        toks = " / ".join(f"{t:,.0f}" for _, t in runs[policy])
        print(f"| --cpu-allocator {policy} | {walls} | {toks} |")
    ratios = [s[0] / r[0] for r, s in zip(runs["retain"], runs["system"], strict=True)]
    print(f"\nsystem / retain wall per round: {' / '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
