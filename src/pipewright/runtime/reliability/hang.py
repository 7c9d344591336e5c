"""Hang reports: where every rank is when a blocking operation times out.

Each rank keeps its current position — (step, phase, position in its schedule row, action) — in
memory (a handler wrapper sets it before every action: no communication on the hot path; the phase
says what the rank does: a training step's or an evaluation's schedule, the optimizer step, which stage
of a checkpoint save), and a daemon thread copies it into the c10d store (``pipewright/position/<rank>``)
when it changed, at most every ``interval_s``. A rank busy in a computation that never ends therefore
still shows where it is.

When a receive times out (:class:`~pipewright.runtime.core.distributed_errors.RecvTimeout`, raised by
``PipeComm``
after ``--recv-timeout`` seconds) or a collective does
(:class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout`, after ``--collective-timeout``
seconds), the
first rank to notice claims the report (an atomic ``add`` on the store), waits a few publishing
intervals, reads every rank's entry, writes ``hang-report.txt`` and puts its first line and the report
into the store. It raises :class:`HangError`: one line naming itself, what it waited for and the report
file, and the report — a line per rank and the schedule grid (ranks × positions, like the validator's
:func:`~pipewright.ir.render_grid`) with each rank's current cell in brackets. Every other rank that
times out, or fails because a peer gave up (a timed-out gloo collective closes its connections),
raises a HangError with that same line and report (:func:`shared_hang`), so whichever rank the launcher
hears from first, the message is the one that explains the hang.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from pipewright.ir import Action
from pipewright.mesh import Mesh
from pipewright.runtime.core.distributed_errors import DistributedError

PREFIX = "pipewright/position/"
log = logging.getLogger(__name__)
_boards = itertools.count()  # boards are made in the same order on every rank: one hang namespace each


def rank_label(
    rank: int, d: int, p: int, t: int, dp: int, tp: int, c: int = 0, cp: int = 1, ep: int = 1
) -> str:
    """``rank R (pp P[, dp D][, ep E][, tp T][, cp C])``: each coordinate shown when its dimension is
    used; the expert-parallel rank E = D mod ep (:mod:`pipewright.mesh`)."""
    parts = [f"pp {p}"]
    for name, value, size in (("dp", d, dp), ("ep", d % ep, ep), ("tp", t, tp), ("cp", c, cp)):
        if size > 1:
            parts.append(f"{name} {value}")
    return f"rank {rank} ({', '.join(parts)})"


def mesh_rank_label(layout: Mesh, rank: int) -> str:
    """:func:`rank_label` of global rank ``rank`` (the process, on device ``rank``) of ``layout``,
    every coordinate from the layout's order and placement."""
    c = layout.coords(layout.rank_on_device(rank))
    return rank_label(rank, c.dp, c.pp, c.tp, layout.dp, layout.tp, c.cp, layout.cp, layout.ep)


class HangError(DistributedError):
    """A blocking operation timed out; ``report`` holds every rank's position and the grid."""

    def __init__(self, message: str, report: str = "") -> None:
        super().__init__(message)
        self.report = report


#: How a phase outside the training step's schedule reads in a report (``{step}``: the Position's).
PHASES = {
    "checkpoint": "saving checkpoint step_{step}",
    "evaluate": "evaluating after step {step}",
}


@dataclass(frozen=True)
class Position:
    """Where one rank is: step, phase ("schedule", "optimizer", "evaluate", "checkpoint", ...), and
    when it runs a schedule (training or evaluation) the index and text of the current action; in
    other phases ``action`` may hold a detail ("writing its shards"). A phase in :data:`PHASES`
    counts its ``step`` as steps done, the others as the 0-based training step."""

    step: int
    phase: str
    index: int = -1
    action: str = ""

    def encode(self) -> str:
        return f"{self.step}|{self.phase}|{self.index}|{self.action}"

    @classmethod
    def decode(cls, text: str) -> Position:
        step, phase, index, action = text.split("|", 3)
        return cls(int(step), phase, int(index), action)

    def describe(self) -> str:
        if self.phase in PHASES:
            where = f"position {self.index} {self.action}" if self.index >= 0 else self.action
            return PHASES[self.phase].format(step=self.step) + (f", {where}" if where else "")
        where = f"position {self.index} {self.action}" if self.index >= 0 else self.phase
        return f"step {self.step}, {where}"


class PositionBoard:
    """This rank's position, published into ``store`` by a daemon thread (see module docstring)."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, interval_s: float = 0.2) -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.hang_key = f"pipewright/hang/{next(_boards)}/"
        self.current = Position(-1, "start")
        self._published: Position | None = None
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._thread = threading.Thread(
                target=self._publish_loop, name="pipewright-position", daemon=True
            )
            self._thread.start()

    @classmethod
    def for_default_group(cls, interval_s: float = 0.2) -> PositionBoard:
        store = None
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        return cls(store, rank, world, interval_s)

    def set(self, step: int, phase: str, index: int = -1, action: Action | None = None) -> None:
        self.current = Position(step, phase, index, "" if action is None else str(action))

    def _publish(self) -> None:
        now = self.current
        if now != self._published and self.store is not None:
            self.store.set(PREFIX + str(self.rank), now.encode())
            self._published = now

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:  # the store is gone (teardown, or the host rank died): nothing to publish to
                return

    def snapshot(self) -> dict[int, Position | None]:
        """Every rank's last published position (None: never published or unreadable)."""
        self._publish()
        out: dict[int, Position | None] = {}
        for r in range(self.world_size):
            key = PREFIX + str(r)
            try:
                out[r] = Position.decode(self.store.get(key).decode()) if self.store.check([key]) else None
            except Exception:
                out[r] = None
        return out

    def first_to_report(self) -> bool:
        """True for exactly one caller over all ranks (an atomic counter in the store)."""
        try:
            return self.store is None or self.store.add(self.hang_key + "claimed", 1) == 1
        except Exception:
            return True

    def claimed(self) -> bool | None:
        """Whether some rank has claimed a hang report (reads the counter without adding); None when
        the store cannot be reached (its host is gone: nobody will report)."""
        try:
            return self.store is not None and self.store.add(self.hang_key + "claimed", 0) > 0
        except Exception:
            return None

    def share(self, line: str, report: str) -> None:
        """Publish the reporting rank's first line and report for the other ranks."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # the store is gone: the others fail on their own
                self.store.set(self.hang_key + "report", f"{line}\n{report}")

    def shared(self, wait_s: float) -> tuple[str, str] | None:
        """The reporting rank's (line, report), waiting up to ``wait_s`` for it; None if it never came."""
        key, end = self.hang_key + "report", time.monotonic() + wait_s
        while self.store is not None:
            try:
                if self.store.check([key]):
                    line, _, report = self.store.get(key).decode().partition("\n")
                    return line, report
            except Exception:
                return None
            if time.monotonic() > end:
                return None
            time.sleep(0.05)
        return None

    def close(self) -> None:
        self._stop.set()


def render_positions(
    rows: Sequence[Sequence[Action]],
    positions: dict[int, Position | None],
    row_of: dict[int, int],
    labels: dict[int, str],
    width: int = 12,
) -> str:
    """One line per rank (its position), then the grid: one row per rank showing its pp rank's actions
    around the marked positions, the current cell in brackets. A position is marked only where its
    action is the one ``rows`` holds there (a rank may be in another phase, or run another schedule);
    without any mark there is no grid."""
    lines = [
        f"{labels[r]}: {p.describe() if p else 'no position published'}" for r, p in sorted(positions.items())
    ]
    row_at = {r: rows[row_of[r]] if row_of[r] < len(rows) else () for r in positions}
    marks = {
        r: p.index
        for r, p in positions.items()
        if p is not None and 0 <= p.index < len(row_at[r]) and str(row_at[r][p.index]) == p.action
    }
    if not marks:
        return "\n".join(lines)
    length = max((len(r) for r in rows), default=0)
    center = (min(marks.values()) + max(marks.values())) // 2
    lo = max(0, min(center - width // 2, length - width))
    hi = min(length, lo + width)
    cells = {}
    for r in sorted(positions):
        row = row_at[r]
        cells[r] = [
            (f"[{row[i]}]" if marks.get(r) == i else str(row[i])) if i < len(row) else ""
            for i in range(lo, hi)
        ]
    col_w = max([len(c) for line in cells.values() for c in line] + [len(str(hi)), 3])
    label_w = max(len(labels[r]) for r in positions)
    lines.append("position".ljust(label_w) + " " + " ".join(str(i).rjust(col_w) for i in range(lo, hi)))
    for r, line in sorted(cells.items()):
        lines.append(labels[r].ljust(label_w) + " " + " ".join(c.rjust(col_w) for c in line))
    if lo > 0 or hi < length:
        lines.append(f"(positions {lo}..{hi - 1} of {length})")
    return "\n".join(lines)


def hang_error(
    cause: Exception,
    board: PositionBoard,
    rows: Sequence[Sequence[Action]],
    row_of: dict[int, int],
    labels: dict[int, str],
    out_dir: Path | None,
) -> HangError:
    """The :class:`HangError` for ``cause`` (a timeout), with every rank's position. The first rank to
    report writes ``out_dir/hang-report.txt`` and shares its line; the others raise that line."""
    if not board.first_to_report():  # another rank writes the report: fail with its line
        got = shared_hang(board, wait_s=10 * board.interval_s + 5)
        if got is not None:
            return got
    time.sleep(3 * board.interval_s)  # the other ranks' threads publish where they are stuck
    report = render_positions(rows, board.snapshot(), row_of, labels)
    first = (str(cause).splitlines() or ["timeout"])[0]
    where = ""
    if out_dir is not None:
        path = Path(out_dir) / "hang-report.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{cause}\n\n{report}\n")
        where = f"; every rank's position in {path}"
    error = HangError(f"hang: {first}{where}", report)
    board.share(str(error), report)
    log.error("%s\n%s", error, report)
    return error


def shared_hang(board: PositionBoard, wait_s: float) -> HangError | None:
    """The hang another rank reported (its line and report), waiting up to ``wait_s``; None if none."""
    got = board.shared(wait_s)
    return None if got is None else HangError(*got)
