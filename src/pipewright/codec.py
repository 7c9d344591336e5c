"""String and CSV forms of actions and schedules, compatible with torch.distributed.pipelining.

An action is ``{stage}{KIND}{microbatch}`` (``"2F0"``, ``"1SEND_F3"``, ``"0REDUCE_GRAD"``). A schedule
CSV has one row per rank, one action per cell, empty cells for idle slots — the format of PyTorch's
``PipelineScheduleMulti._dump_csv`` / ``_load_csv`` (``compute_only`` and ``compute_comms``).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from pathlib import Path

from pipewright.errors import PipewrightError
from pipewright.ir import Action, KindRegistry, Schedule


def _pattern(kinds: KindRegistry) -> re.Pattern[str]:
    names = sorted(kinds, key=len, reverse=True)
    return re.compile(rf"^(\d+)({'|'.join(map(re.escape, names))})(\d*)(?::(.+))?$")


def parse_action(text: str, kinds: KindRegistry | None = None) -> Action:
    """Parse ``"2F0"`` into ``Action(2, "F", 0)``; a clear error for anything else."""
    from pipewright.deps import CORE_KINDS

    match = _pattern(kinds or CORE_KINDS).match(text.strip())
    if not match:
        raise PipewrightError(
            f"cannot read action {text!r}: expected STAGE KIND [MICROBATCH], e.g. '2F0' or '1SEND_F3'"
        )
    stage, kind, mb, payload = match.groups()
    return Action(int(stage), kind, int(mb) if mb else None, payload)


def rows_to_csv(rows: Iterable[Iterable[Action | None]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])
    return buf.getvalue()


def from_csv(
    text: str,
    *,
    name: str = "csv",
    num_stages: int | None = None,
    placement: tuple[int, ...] | None = None,
    kinds: KindRegistry | None = None,
) -> Schedule:
    """Read a PyTorch schedule CSV. Stages, microbatches and placement are inferred when not given."""
    from pipewright.deps import CORE_KINDS

    kinds = kinds or CORE_KINDS
    rows = [
        [parse_action(cell, kinds) for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))
    ]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise PipewrightError("the schedule CSV has no actions")
    stage_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for a in row:
            if stage_rank.setdefault(a.stage, rank) != rank:
                raise PipewrightError(f"stage {a.stage} appears on ranks {stage_rank[a.stage]} and {rank}")
    # every stage and microbatch needs an action, so a number past the action count is a typo (and
    # would make the checks below walk billions of stages)
    n_actions = sum(map(len, rows))
    mbs = [a.microbatch for row in rows for a in row if a.microbatch is not None]
    for what, top in (("stage", max(stage_rank)), ("microbatch", max(mbs, default=0))):
        if top >= n_actions:
            raise PipewrightError(
                f"{what} {top} in a CSV of {n_actions} actions: number them 0, 1, ... without gaps"
            )
    n_stages = num_stages or max(stage_rank) + 1
    if placement is None:
        missing = [s for s in range(n_stages) if s not in stage_rank]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise PipewrightError(f"the CSV never runs stage(s) {missing[:5]}{more}")
        placement = tuple(stage_rank[s] for s in range(n_stages))
    lowered = any(kinds[a.kind].comm in ("send", "recv") for row in rows for a in row)
    return Schedule(
        name=name,
        num_ranks=len(rows),
        num_stages=n_stages,
        num_microbatches=max(mbs) + 1 if mbs else 0,
        placement=placement,
        actions=tuple(tuple(r) for r in rows),
        kinds=kinds,
        lowered=lowered,
    )


def load_csv(path: str | Path, **kwargs) -> Schedule:
    from pipewright.files import read_text

    path = Path(path)
    return from_csv(read_text(path, "schedule file"), name=path.stem, **kwargs)
