"""Print Megatron-LM Table 1, published vs predicted TFLOP/s per GPU, as a markdown table.

    PYTHONPATH=src python tools/table1.py [--simulate] [--csv reference/megatron_table1.csv]

The prediction uses the calibrated A100 efficiency (pipewright.cost.transformer.A100_EFFICIENCY) and
the closed-form iteration time, or the discrete-event simulator with ``--simulate``.
"""

from __future__ import annotations

import argparse

from pipewright.cost.megatron import (
    TABLE1,
    closed_form_iteration_time,
    load_table1,
    predict_table1_row,
    simulated_iteration_time,
)
from pipewright.cost.transformer import A100_EFFICIENCY


def markdown(rows, efficiency=A100_EFFICIENCY, iteration_time=closed_form_iteration_time) -> str:
    lines = [
        "| model | t | p | d | v | b | m | GPUs | published TFLOP/s | predicted TFLOP/s | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for row in rows:
        predicted = predict_table1_row(row, efficiency, iteration_time)
        error = predicted / row.tflops_per_gpu - 1
        worst = max(worst, abs(error))
        lines.append(
            f"| {row.name} | {row.tp} | {row.pp} | {row.dp} | {row.virtual_chunks} | {row.microbatch} "
            f"| {row.microbatches} | {row.gpus} | {row.tflops_per_gpu:g} | {predicted:.1f} | {error:+.1%} |"
        )
    lines.append("")
    lines.append(
        f"Efficiency: gemm {efficiency.gemm}, memory_traffic {efficiency.memory_traffic}, "
        f"comm {efficiency.comm}. Largest error: {worst:.1%}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="use the discrete-event simulator")
    parser.add_argument("--csv", help="read the table from this CSV instead of the built-in copy")
    args = parser.parse_args()
    rows = load_table1(args.csv) if args.csv else TABLE1
    timer = simulated_iteration_time if args.simulate else closed_form_iteration_time
    print(markdown(rows, iteration_time=timer))


if __name__ == "__main__":
    main()
