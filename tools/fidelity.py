"""Published training runs vs ``pipewright simulate``: the table of docs/fidelity.md.

    PYTHONPATH=src python tools/fidelity.py [--markdown] [--only ID_PREFIX]

Each row of the package's published_runs.csv (pipewright.cost.fidelity) runs through the command line
in-process (``pipewright.cli.main``) and prints the published and predicted tokens/s per GPU, the
error, and the peak memory where published.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from pipewright.cli import main as cli_main
from pipewright.cost.fidelity import load_runs, published_tokens_per_s, simulate_argv
from pipewright.hardware import accelerator


def predict(run) -> dict:
    """Run the row's command; its report plus predicted tokens/s per GPU (or the error line)."""
    argv = simulate_argv(run)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([*argv, "--json"])
    if rc != 0:
        return {"error": err.getvalue().strip()}
    report = json.loads(out.getvalue())
    tokens = run.int("global_batch_size") * run.seq / report["iteration_time_s"] / run.gpus
    peak_mem = max(r["peak_memory_bytes"] for r in report["per_rank"])
    return {"tokens": tokens, "memory_gib": peak_mem / 2**30, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose id starts with this")
    args = parser.parse_args()
    for run in load_runs():
        if not run.id.startswith(args.only):
            continue
        gpu = accelerator(run["gpu"] if run["gpu"] != "a100" else "a100-80gb")
        dtype = run["dtype"] or "bf16"
        peak = gpu.peak("bf16" if dtype == "fp8" else dtype) if dtype in gpu.peak_flops else None
        pub = published_tokens_per_s(run, peak)
        if pub is None or not run.int("global_batch_size"):
            print(f"{run.id:50s} skip: no throughput or batch")
            continue
        got = predict(run)
        if "error" in got:
            print(f"{run.id:50s} ERROR {got['error']}")
            continue
        mem = run.float("memory_gb")
        mtxt = f" mem {got['memory_gib']:.1f} vs {mem:.1f}" if mem else ""
        print(f"{run.id:50s} pub {pub:10.1f} pred {got['tokens']:10.1f} err {got['tokens'] / pub - 1:+.1%}{mtxt}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
