"""Published training runs vs ``pipewright simulate``: writes the runs' specs, docs/fidelity.md and the
expected table.

    PYTHONPATH=src python tools/fidelity.py --write-specs  # cost/data/published_runs/<id>.toml
    PYTHONPATH=src python tools/fidelity.py                # print the comparison
    PYTHONPATH=src python tools/fidelity.py --write        # docs/fidelity.md, cost/data/fidelity_expected.csv

Each row of the package's published_runs.csv (pipewright.cost.fidelity) is a RunSpec in package data
(pipewright.cost.published_specs), simulated in-process (pipewright.cli.fidelity_predictions.predict).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter
from pathlib import Path

from pipewright.cli.fidelity_predictions import Outcome, predict, summary
from pipewright.cost import frameworks
from pipewright.cost.fidelity import OVERRIDES, framework_of, load_runs
from pipewright.cost.published_specs import SPEC_DIR, spec_texts

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "src" / "pipewright" / "cost" / "data" / "fidelity_expected.csv"
DOC = ROOT / "docs" / "fidelity.md"
SPECS = ROOT / "src" / "pipewright" / "cost" / SPEC_DIR
HOPPER = ("h100", "h200", "h800", "b200")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _stats_line(name: str, outcomes: list[Outcome]) -> str:
    s = summary(outcomes)
    return f"| {name} | {s['rows']} | {s['median']:.1%} | {s['max']:.1%} | {s['within_10']:.0%} |"


def markdown(outcomes: list[Outcome], header: str) -> str:
    done = [o for o in outcomes if o.time_error is not None]
    held = [o for o in done if not o.fitted]
    fit = [o for o in done if o.fitted]
    hopper = [o for o in held if o.run["gpu"].startswith(HOPPER)]
    sources = Counter(o.run["source"] for o in done)
    lines = [header, ""]
    new = len([o for o in done if o.run["gpu"].startswith(HOPPER)])
    lines.append(
        f"{len(done)} runs simulated from {len(sources)} sources ({new} on H100 or newer); "
        f"{len(fit)} used for fitting, {len(held)} held out."
    )
    lines += ["", "| rows | n | median abs. error | largest | within 10 % |", "|---|---:|---:|---:|---:|"]
    lines.append(_stats_line("held out", held))
    lines.append(_stats_line("held out, H100 or newer", hopper))
    for name in frameworks.names():
        lines.append(
            _stats_line(f"held out, `--framework {name}`", [o for o in held if framework_of(o.run) == name])
        )
    lines.append(_stats_line("fitted", fit))
    lines.append(_stats_line("all", done))
    for source in sorted(sources):
        lines.append(_stats_line(f"`{source}`", [o for o in done if o.run["source"] == source]))
    lines += ["", *framework_table(done)]
    mem = [o for o in done if o.memory_error is not None]
    if mem:
        within = sum(abs(o.memory_error) <= 0.15 for o in mem)
        lines += ["", f"Memory: {len(mem)} runs publish it; {within} predicted within 15 %."]
    lines += ["", "## Runs", ""]
    lines.append(
        "| run | GPU | fit | published tok/s/GPU | predicted | error | memory pub./pred. GiB | error |"
    )
    lines.append("|---|---|:-:|---:|---:|---:|---:|---:|")
    for o in outcomes:
        if o.time_error is None:
            continue
        pm = o.published_memory_gib
        mem_cell = "—" if pm is None else f"{pm:.1f} / {o.memory_gib:.1f}"
        lines.append(
            f"| `{o.run.id}` | {o.run['gpu']} | {'fit' if o.fitted else ''} | {o.published:,.1f} | "
            f"{o.predicted:,.1f} | {_pct(o.time_error)} | {mem_cell} | {_pct(o.memory_error)} |"
        )
    skipped = [o for o in outcomes if o.time_error is None]
    if skipped:
        lines += ["", "Not simulated:", ""]
        lines += [f"- `{o.run.id}`: {o.error}" for o in skipped]
    lines += ["", "## Assumptions per row", ""]
    by_reason: dict[str, list[str]] = {}
    for prefix, (_, reason) in OVERRIDES.items():
        by_reason.setdefault(reason, []).append(f"`{prefix}*`")
    lines += [f"- {', '.join(prefixes)}: {reason}" for reason, prefixes in by_reason.items()]
    lines += ["", "## Specs", ""]
    lines.append(
        f"Each run above is the RunSpec `src/pipewright/cost/{SPEC_DIR}/<run>.toml` (package data, written "
        "from the row by `tools/fidelity.py --write-specs`; [How a run becomes a command]"
        "(#how-a-run-becomes-a-command) shows one and how to simulate it)."
    )
    return "\n".join(lines) + "\n"


def framework_table(done: list[Outcome]) -> list[str]:
    """The registry of pipewright.cost.frameworks: defaults, fitted parameters, rows fitted / rows."""
    lines = [
        "| `--framework` | defaults | compute factor c | τ_f ms per layer | rows fitted / rows |",
        "|---|---|---:|---:|---:|",
    ]
    for name in frameworks.names():
        fw = frameworks.framework(name)
        rows = [o for o in done if framework_of(o.run) == name]
        defaults = ", ".join(f"`--{k.replace('_', '-')} {v}`" for k, v in fw.defaults.items()) or "—"
        fitted = sum(o.fitted for o in rows)
        lines.append(
            f"| `{name}` | {defaults} | {fw.compute:.4f} | {fw.overhead * 1e3:.3f} | {fitted} / {len(rows)} |"
        )
    return lines


def expected_csv(outcomes: list[Outcome]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["id", "published", "predicted", "memory_gib", "fit"])
    for o in outcomes:
        if o.time_error is not None:
            w.writerow(
                [o.run.id, f"{o.published:.6g}", f"{o.predicted:.6g}", f"{o.memory_gib:.4f}", int(o.fitted)]
            )
    return out.getvalue()


def write_specs() -> None:
    """The package's spec files: one per row of the CSV, none left from rows since removed."""
    texts = spec_texts(load_runs())
    SPECS.mkdir(exist_ok=True)
    for stale in SPECS.glob("*.toml"):
        if stale.name not in texts:
            stale.unlink()
    for name, text in texts.items():
        (SPECS / name).write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rows whose id starts with this")
    parser.add_argument("--write", action="store_true", help="write docs/fidelity.md and the expected CSV")
    parser.add_argument("--write-specs", action="store_true", help="write the runs' specs from the CSV")
    args = parser.parse_args()
    if args.write_specs:
        write_specs()
        return
    outcomes = []
    for run in load_runs():
        if not run.id.startswith(args.only):
            continue
        o = predict(run)
        outcomes.append(o)
        err = o.error or f"pub {o.published:10.1f} pred {o.predicted:10.1f} {_pct(o.time_error)}"
        print(f"{run.id:48s} {err}", file=sys.stderr)
    if args.write:
        EXPECTED.write_text(expected_csv(outcomes))
        head = DOC.read_text().split("<!-- table -->")[0] + "<!-- table -->"
        DOC.write_text(markdown(outcomes, head))


if __name__ == "__main__":
    main()
