"""Markdown tables and row reports for the tools in this folder (the library does not import it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: column alignment → the separator cell under its header
_SEPARATOR = {"l": "---", "r": "---:"}


def markdown_table(header: str, align: str, rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``header`` (column names separated by `` | ``), ``align`` one letter per column
    (``l`` left, ``r`` right), then one line per row of already formatted cells."""
    columns = header.split(" | ")
    if len(align) != len(columns):
        raise ValueError(f"{len(columns)} columns but {len(align)} alignments ({align!r})")
    lines = [_line(columns), "|" + "|".join(_SEPARATOR[a] for a in align) + "|"]
    lines += [_line(row) for row in rows]
    return "\n".join(lines)


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def report_rows(rows: Iterable[dict], markdown: Callable[[list[dict]], str], json_path: str | None) -> None:
    """Print each row as one JSON line as it comes, then ``markdown(rows)``; write the rows as JSON to
    ``json_path`` too when given."""
    done = []
    for row in rows:
        done.append(row)
        print(json.dumps(row), flush=True)
    print(markdown(done))
    if json_path:
        Path(json_path).write_text(json.dumps(done, indent=1) + "\n")
