"""A user's measured runs (``pipewright calibrate --measured RUNS.csv``): reading, predicting, scoring.

The file is CSV with one measured run per row. Lines before the header line (the first line naming
``iteration time (ms)``) are comments. Columns (vTrain's ``data/ground_truth_single.csv`` names, so
its file reads as it is; ``# GPUs`` may be written ``GPUs``):

==========================  =====================================================================
column                      meaning
==========================  =====================================================================
``GPUs``                    GPUs of the run (tp × dp × pp)
``global batch``            sequences per iteration
``micro batch``             sequences per microbatch
``hidden size``             model hidden size
``attention heads``         attention heads
``# layers``                transformer layers
``sequence length``         tokens per sequence
``tensor parallelism``      tp
``data parallelism``        dp
``pipeline parallelism``    pp
``iteration time (ms)``     the measured time of one iteration, milliseconds
==========================  =====================================================================

What the file does not say (GPU, framework, dtype, recomputation, attention, gradient reduction, the
vocabulary) comes from ``calibrate``'s flags and is the same for every row.

Scores (:func:`score`): per row the signed error predicted / measured − 1; over the rows the mean of
its absolute value (MAPE), the median absolute, the worst; per (tp, microbatch) cell the median
signed error; and ranking quality per **group** — the rows of one model (layers, hidden, heads,
sequence) on one GPU count and global batch, the layouts a planner chooses among: the **regret**
(the measured time of the layout predicted fastest over the measured fastest, − 1) and Spearman's
rank correlation ρ between predicted and measured times (groups of at least three rows).

The fixed split (:func:`split`): rows sorted by group, then by (tp, pp, dp, microbatch); within each
group the 1st, 3rd, … fit the calibration, the 2nd, 4th, … are held out and scored.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pipewright.errors import ConfigError

TIME = "iteration time (ms)"
#: column → the field of :class:`MeasuredRun` it fills
COLUMNS: Mapping[str, str] = {
    "GPUs": "gpus",
    "global batch": "global_batch",
    "micro batch": "microbatch",
    "hidden size": "hidden",
    "attention heads": "heads",
    "# layers": "layers",
    "sequence length": "seq_len",
    "tensor parallelism": "tp",
    "data parallelism": "dp",
    "pipeline parallelism": "pp",
}
_ALIASES = {"# GPUs": "GPUs"}
#: the vTrain rows shipped with the package (hidden size 1024; the file's first lines give the source)
VTRAIN_DATA = "data/vtrain_single_node_hidden1024.csv"


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run (module docstring); ``line``: its line in the file (for messages)."""

    gpus: int
    global_batch: int
    microbatch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tp: int
    dp: int
    pp: int
    seconds: float
    line: int = 0

    @property
    def group(self) -> tuple[int, ...]:
        """One model on one GPU count and global batch (module docstring)."""
        return (self.layers, self.hidden, self.heads, self.seq_len, self.gpus, self.global_batch)

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return (self.tp, self.pp, self.dp, self.microbatch)


def _integer(text: str, column: str, line: int) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"line {line}, column {column!r}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ConfigError(f"line {line}, column {column!r}: {text!r} must be a positive whole number")
    return int(value)


def parse_runs(text: str, where: str = "measured runs") -> tuple[MeasuredRun, ...]:
    """The runs of a measured-runs file's ``text``; a one-line ConfigError naming the line and column of
    the first bad value (a missing column, a time that is not a positive finite number, a layout
    whose tp × dp × pp is not the GPUs or whose batch the microbatches × dp do not divide)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if TIME in line), None)
    if header is None:
        raise ConfigError(f"{where}: no header line with the column {TIME!r}")
    reader = csv.reader(io.StringIO("\n".join(lines[header:])))
    names = [_ALIASES.get(n.strip(), n.strip()) for n in next(reader)]
    missing = [c for c in (*COLUMNS, TIME) if c not in names]
    if missing:
        raise ConfigError(f"{where}: line {header + 1}: missing column(s) {', '.join(map(repr, missing))}")
    runs = []
    for offset, values in enumerate(reader, start=header + 2):
        if not values or all(not v.strip() for v in values):
            continue
        if len(values) != len(names):
            raise ConfigError(f"{where}: line {offset}: {len(values)} values for {len(names)} columns")
        row = dict(zip(names, (v.strip() for v in values), strict=True))
        fields = {field: _integer(row[col], col, offset) for col, field in COLUMNS.items()}
        try:
            ms = float(row[TIME])
        except ValueError:
            raise ConfigError(
                f"{where}: line {offset}, column {TIME!r}: {row[TIME]!r} is not a number"
            ) from None
        if not math.isfinite(ms) or ms <= 0:
            raise ConfigError(f"{where}: line {offset}, column {TIME!r}: must be a positive finite time")
        run = MeasuredRun(**fields, seconds=ms / 1e3, line=offset)
        if run.tp * run.dp * run.pp != run.gpus:
            raise ConfigError(
                f"{where}: line {offset}, column 'GPUs': tp {run.tp} × dp {run.dp} × pp {run.pp} "
                f"= {run.tp * run.dp * run.pp}, not {run.gpus}"
            )
        if run.global_batch % (run.microbatch * run.dp):
            raise ConfigError(
                f"{where}: line {offset}, column 'global batch': {run.global_batch} is not a multiple of "
                f"micro batch × dp = {run.microbatch * run.dp}"
            )
        runs.append(run)
    if not runs:
        raise ConfigError(f"{where}: no runs after the header")
    return tuple(runs)


def load_runs(path: str | Path) -> tuple[MeasuredRun, ...]:
    """Read a measured-runs file (:func:`parse_runs`); one line when it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read measured runs {path}: {exc.strerror}") from None
    return parse_runs(text, str(path))


def vtrain_runs() -> tuple[MeasuredRun, ...]:
    """vTrain's hidden-1024 rows shipped with the package (:data:`VTRAIN_DATA`)."""
    text = resources.files("pipewright.cost").joinpath(VTRAIN_DATA).read_text()
    return parse_runs(text, VTRAIN_DATA)


def split(runs: Sequence[MeasuredRun]) -> tuple[tuple[MeasuredRun, ...], tuple[MeasuredRun, ...]]:
    """(fit half, held-out half) by the fixed rule of the module docstring."""
    ordered = sorted(runs, key=lambda r: (r.group, r.layout))
    fit: list[MeasuredRun] = []
    held: list[MeasuredRun] = []
    index: dict[tuple[int, ...], int] = {}
    for run in ordered:
        i = index[run.group] = index.get(run.group, -1) + 1
        (fit if i % 2 == 0 else held).append(run)
    return tuple(fit), tuple(held)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties get their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 1.0


@dataclass(frozen=True)
class Score:
    """The scores of the module docstring over a set of runs."""

    rows: int
    mape: float
    median: float
    worst: float  # the signed error of largest magnitude
    cells: Mapping[tuple[int, int], float]  # (tp, microbatch) → median signed error
    groups: int
    regret_median: float
    regret_worst: float
    rank_median: float  # median Spearman ρ over groups of ≥ 3 rows
    rank_groups: int

    def lines(self) -> list[str]:
        """The report, one statistic per line."""
        worst_cell = max(self.cells.items(), key=lambda kv: abs(kv[1]))
        return [
            f"rows {self.rows}: MAPE {self.mape:.1%}, median {self.median:.1%}, worst {self.worst:+.1%}",
            f"(tp, microbatch) cells: worst median {worst_cell[1]:+.1%} at tp {worst_cell[0][0]}, "
            f"microbatch {worst_cell[0][1]}",
            f"groups {self.groups}: regret median {self.regret_median:.1%}, worst {self.regret_worst:.1%}",
            f"rank correlation (Spearman, {self.rank_groups} groups of ≥ 3): median {self.rank_median:.2f}",
        ]

    def as_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "mape": self.mape,
            "median": self.median,
            "worst": self.worst,
            "cells": {f"tp{t}-mb{b}": e for (t, b), e in sorted(self.cells.items())},
            "groups": self.groups,
            "regret_median": self.regret_median,
            "regret_worst": self.regret_worst,
            "rank_median": self.rank_median,
            "rank_groups": self.rank_groups,
        }


def score(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> Score:
    """Errors and ranking quality of ``predicted`` seconds against ``runs`` (module docstring)."""
    errors = [p / r.seconds - 1 for r, p in zip(runs, predicted, strict=True)]
    by_cell: dict[tuple[int, int], list[float]] = {}
    groups: dict[tuple[int, ...], list[tuple[float, float]]] = {}
    for run, err, p in zip(runs, errors, predicted, strict=True):
        by_cell.setdefault((run.tp, run.microbatch), []).append(err)
        groups.setdefault(run.group, []).append((p, run.seconds))
    regrets, ranks = [], []
    for pairs in groups.values():
        best = min(m for _, m in pairs)
        chosen = min(pairs)[1]
        regrets.append(chosen / best - 1)
        if len(pairs) >= 3:
            ranks.append(spearman([p for p, _ in pairs], [m for _, m in pairs]))
    return Score(
        rows=len(runs),
        mape=statistics.fmean(abs(e) for e in errors),
        median=statistics.median(abs(e) for e in errors),
        worst=max(errors, key=abs),
        cells={k: statistics.median(v) for k, v in by_cell.items()},
        groups=len(groups),
        regret_median=statistics.median(regrets),
        regret_worst=max(regrets),
        rank_median=statistics.median(ranks) if ranks else float("nan"),
        rank_groups=len(ranks),
    )


def run_values(run: MeasuredRun, per_node: int = 8) -> dict[tuple[str, ...], object]:
    """The RunSpec values of ``run`` for ``pipewright simulate``, by path: its layout and model (GPT,
    FFN 4h), the 1F1B schedule, on machines of ``per_node`` GPUs. What the file does not carry (the
    GPU, framework, dtype, …) is ``calibrate``'s, the same for every run."""
    nodes = max(1, math.ceil(run.gpus / per_node))
    return {
        ("model", "model"): "gpt",
        ("model", "layers"): run.layers,
        ("model", "hidden"): run.hidden,
        ("model", "heads"): run.heads,
        ("model", "seq_len"): run.seq_len,
        ("cluster", "nodes"): nodes,
        ("cluster", "gpus_per_node"): min(per_node, run.gpus),
        ("parallelism", "tp"): run.tp,
        ("parallelism", "pp"): run.pp,
        ("parallelism", "dp"): run.dp,
        ("schedule", "name"): "1f1b",
        ("batch", "microbatch_size"): run.microbatch,
        ("batch", "global_batch_size"): run.global_batch,
    }
