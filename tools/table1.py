"""Print Megatron-LM Table 1, published vs predicted TFLOP/s per GPU, as a markdown table.

    PYTHONPATH=src python tools/table1.py [--csv FILE]   (default: the package's data/megatron_table1.csv)

The prediction uses the calibrated A100 efficiency (pipewright.cost.transformer.A100_EFFICIENCY), with
the iteration time from the discrete-event simulator and, for comparison, Megatron's closed form.
"""

from __future__ import annotations

import argparse

from _table import markdown_table

from pipewright.cost.megatron import closed_form_iteration_time, load_table1, packaged_table1
from pipewright.cost.transformer import A100_EFFICIENCY
from pipewright.plan.table1 import predict_table1_row, simulated_iteration_time


def markdown(rows, efficiency=A100_EFFICIENCY) -> str:
    header = (
        "model | t | p | d | v | b | m | GPUs | published TFLOP/s | simulated | error | closed form | error"
    )
    worst = {"sim": 0.0, "closed": 0.0}
    cells = []
    for row in rows:
        line: list[object] = [row.name, row.tp, row.pp, row.dp, row.virtual_chunks, row.microbatch]
        line += [row.microbatches, row.gpus, f"{row.tflops_per_gpu:g}"]
        for key, timer in (("sim", simulated_iteration_time), ("closed", closed_form_iteration_time)):
            predicted = predict_table1_row(row, efficiency, timer)
            error = predicted / row.tflops_per_gpu - 1
            worst[key] = max(worst[key], abs(error))
            line += [f"{predicted:.1f}", f"{error:+.1%}"]
        cells.append(line)
    lines = [markdown_table(header, "l" + "r" * 12, cells)]
    lines.append("")
    lines.append(
        f"Efficiency: gemm {efficiency.gemm}, memory_traffic {efficiency.memory_traffic}, "
        f"comm {efficiency.comm}. Largest error: {worst['sim']:.1%} simulated, "
        f"{worst['closed']:.1%} closed form."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="read the table from this CSV instead of the built-in copy")
    args = parser.parse_args()
    rows = load_table1(args.csv) if args.csv else packaged_table1()
    print(markdown(rows))


if __name__ == "__main__":
    main()
