"""The schedule IR: actions, action kinds, stage placement, and the per-rank action lists.

Actions, kinds and events are defined in :mod:`pipewright.kinds` and re-exported here. A
:class:`Schedule` holds, for every pipeline rank, the ordered tuple of actions it performs in one
training iteration, plus the stage→rank placement. What each kind needs before it may run lives in
:mod:`pipewright.deps`; kinds themselves are described by :class:`KindSpec` values collected in an
immutable :class:`KindRegistry` that features extend by ``registry.with_kinds(...)``.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from pipewright.deps import CORE_KINDS
from pipewright.kinds import (
    COLLECTIVE_OPS,
    MESH_GROUPS,
    P2P,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    STEP,
    Action,
    B,
    Collective,
    Event,
    F,
    I,
    KindRegistry,
    KindSpec,
    W,
    event_action,
)

__all__ = [
    "COLLECTIVE_OPS",
    "CORE_KINDS",
    "MESH_GROUPS",
    "P2P",
    "RECV_B",
    "RECV_F",
    "REDUCE_GRAD",
    "SEND_B",
    "SEND_F",
    "STEP",
    "Action",
    "ActionColumns",
    "B",
    "Collective",
    "Event",
    "F",
    "I",
    "KindRegistry",
    "KindSpec",
    "Schedule",
    "W",
    "event_action",
    "loop_placement",
    "peak_in_flight",
    "render_grid",
    "v_placement",
]


def loop_placement(ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """Stage s on rank s mod p (Megatron's interleaved placement; plain when chunks = 1)."""
    return tuple(s % ranks for s in range(ranks * chunks))


def v_placement(ranks: int) -> tuple[int, ...]:
    """V placement (ZB-V, V-Half, V-Min, DualPipeV): rank i holds stages i and 2p − 1 − i."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


@dataclass(frozen=True)
class ActionColumns:
    """Every rank's actions as columns (what schedule generators of the common schedules emit, and
    what :mod:`pipewright.sim.lowered_compile` reads without one Python object per action).

    Action i is ``Action(stage[i], kinds[kind[i]], microbatch[i] or None when −1)``, ranks one after
    another: rank r holds the ``lens[r]`` actions after those of ranks 0 … r − 1. The columns are
    integer sequences with ``tolist()`` (numpy arrays; nothing here imports numpy).
    """

    kinds: tuple[str, ...]
    kind: Any
    stage: Any
    microbatch: Any
    lens: Any

    def rows(self) -> tuple[tuple[Action, ...], ...]:
        """The per-rank action tuples these columns describe."""
        names = self.kinds
        acts = list(
            map(
                Action,
                self.stage.tolist(),
                [names[c] for c in self.kind.tolist()],
                [None if k < 0 else k for k in self.microbatch.tolist()],
            )
        )
        out, at = [], 0
        for n in self.lens.tolist():
            out.append(tuple(acts[at : at + n]))
            at += n
        return tuple(out)


@dataclass(frozen=True)
class Schedule:
    """One training iteration: for each rank, the ordered actions it runs.

    ``placement[s]`` is the rank that holds stage (model chunk) ``s``. ``lowered`` is True once the
    send/receive actions are explicit (then cross-rank data dependencies go through RECV actions).
    ``meta`` holds schedule-specific facts (e.g. ``{"flush": False}`` for asynchronous schedules).
    ``actions`` may be given as :class:`ActionColumns` (:meth:`from_columns`): the action tuples are
    then built on first access, and :attr:`columns` keeps the columns.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    kinds: KindRegistry = field(default=None, compare=False)  # type: ignore[assignment]
    lowered: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kinds is None:
            object.__setattr__(self, "kinds", CORE_KINDS)
        if len(self.placement) != self.num_stages:
            raise ValueError(f"placement has {len(self.placement)} entries for {self.num_stages} stages")
        cols = self.__dict__["_columns"]
        rows = len(cols.lens) if cols is not None else len(self.__dict__["_rows"])
        if rows != self.num_ranks:
            raise ValueError(f"{rows} action lists for {self.num_ranks} ranks")

    @property
    def columns(self) -> ActionColumns | None:
        """The actions as columns when the schedule was built from them, else None."""
        return self.__dict__["_columns"]

    @classmethod
    def from_columns(
        cls,
        name: str,
        microbatches: int,
        columns: ActionColumns,
        placement: tuple[int, ...],
        *,
        flush: bool = True,
        **meta: Any,
    ) -> Schedule:
        """A compute-only schedule from :class:`ActionColumns` (its action tuples built on demand)."""
        return cls(
            name=name,
            num_ranks=len(columns.lens),
            num_stages=len(placement),
            num_microbatches=microbatches,
            placement=placement,
            actions=columns,  # type: ignore[arg-type]
            meta={"flush": flush, **meta},
        )

    @classmethod
    def build(
        cls,
        name: str,
        microbatches: int,
        rows: Iterable[Iterable[Action]],
        placement: tuple[int, ...],
        *,
        flush: bool = True,
        **meta: Any,
    ) -> Schedule:
        """A compute-only schedule from per-rank action rows (what schedule generators return)."""
        actions = tuple(tuple(r) for r in rows)
        return cls(
            name=name,
            num_ranks=len(actions),
            num_stages=len(placement),
            num_microbatches=microbatches,
            placement=placement,
            actions=actions,
            meta={"flush": flush, **meta},
        )

    @property
    def chunks_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def local(self, stage_a: int, stage_b: int) -> bool:
        """True when both stages sit on one rank (a hand-off without send/receive)."""
        return self.placement[stage_a] == self.placement[stage_b]

    def with_actions(
        self, actions: Iterable[Iterable[Action]], *, lowered: bool | None = None, **changes: Any
    ) -> Schedule:
        return replace(
            self,
            actions=tuple(tuple(a) for a in actions),
            lowered=self.lowered if lowered is None else lowered,
            **changes,
        )

    def __len__(self) -> int:
        cols = self.__dict__["_columns"]
        if cols is not None:
            return int(sum(cols.lens.tolist()))
        return sum(len(r) for r in self.actions)

    def grid(self, mark: tuple[int, int] | None = None, width: int | None = None) -> str:
        """Text grid, one row per rank, one column per position; ``mark`` = (rank, pos) is bracketed.

        With ``width`` set, only ``width`` columns around the mark (or from the start) are shown.
        """
        return render_grid(self.actions, mark=mark, width=width)

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches\n{self.grid(width=40)}"
        )


def _get_actions(self: Schedule) -> tuple[tuple[Action, ...], ...]:
    rows = self.__dict__["_rows"]
    if rows is None:  # built from columns: the tuples on first access
        rows = self.__dict__["_rows"] = self.__dict__["_columns"].rows()
    return rows


def _set_actions(self: Schedule, value: Any) -> None:
    """The dataclass ``__init__`` sets ``actions`` here: tuples, or columns kept for later."""
    if isinstance(value, ActionColumns):
        self.__dict__["_rows"], self.__dict__["_columns"] = None, value
    else:
        self.__dict__["_rows"], self.__dict__["_columns"] = value, None


Schedule.actions = property(_get_actions, _set_actions, doc="Per rank, the ordered actions.")  # type: ignore[assignment,method-assign]


def render_grid(
    rows: tuple[tuple[Action, ...], ...] | list[list[Action]],
    mark: tuple[int, int] | None = None,
    width: int | None = None,
) -> str:
    """Ranks × positions as aligned text. Used in error messages and ``pipewright schedule show``."""
    length = max((len(r) for r in rows), default=0)
    lo, hi = 0, length
    if width is not None and length > width:
        center = mark[1] if mark else 0
        lo = max(0, min(center - width // 2, length - width))
        hi = lo + width
    cells = []
    for rank, row in enumerate(rows):
        line = []
        for pos in range(lo, hi):
            text = str(row[pos]) if pos < len(row) else ""
            if mark == (rank, pos):
                text = f"[{text}]"
            line.append(text)
        cells.append(line)
    col_w = max([len(c) for line in cells for c in line] + [len(str(hi)), 3])
    header = "step   " + " ".join(str(p).rjust(col_w) for p in range(lo, hi))
    out = [header]
    for rank, line in enumerate(cells):
        out.append(f"rank {rank:<2}" + " ".join(c.rjust(col_w) for c in line))
    if lo > 0 or hi < length:
        out.append(f"(positions {lo}..{hi - 1} of {length})")
    return "\n".join(out)


def peak_in_flight(schedule: Schedule) -> list[Fraction]:
    """Peak activation memory per rank, in microbatches of a whole rank's layers.

    Each action kind's ``memory`` delta counts one chunk-microbatch; a rank holds ``v`` chunks, so one
    chunk-microbatch is 1/v of a microbatch's activations on that rank (F adds, W or B frees).
    """
    v = schedule.chunks_per_rank or 1
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            live += schedule.kinds[a.kind].memory
            peak = max(peak, live)
        peaks.append(Fraction(peak, v))
    return peaks
