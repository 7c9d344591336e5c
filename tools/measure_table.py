"""Measure every row of :data:`pipewright.measure.table.ROWS` (one pipeline rank each, full size, meta
tensors) against the simulator; write src/pipewright/measure/data/measured_ranks.json and print the
Markdown table of docs/fidelity.md's section "The real program against the simulator".

    PYTHONPATH=src python tools/measure_table.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipewright.measure import measure_run
from pipewright.measure.table import DATA, ROWS, markdown, record
from pipewright.training import config_from_values

OUT = Path(__file__).resolve().parents[1] / "src" / "pipewright" / "measure" / "data" / DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="measure only the rows whose name contains this (others kept)")
    args = parser.parse_args()
    old = {r["name"]: r for r in json.loads(OUT.read_text())} if OUT.exists() else {}
    rows = []
    for name, fields, pp_rank in ROWS:
        if args.only and args.only not in name and name in old:
            rows.append(old[name])
            continue
        t0 = time.perf_counter()
        (cmp,) = measure_run(config_from_values(fields), [pp_rank])
        rows.append(record(name, fields, cmp))
        print(f"{name}: {time.perf_counter() - t0:.1f} s; outside the targets: {cmp.misses()}", flush=True)
        OUT.write_text(
            json.dumps(rows + [old[n] for n, *_ in ROWS[len(rows) :] if n in old], indent=1) + "\n"
        )
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
