"""The Timeline: what each rank did when. The simulator predicts one, the runtime measures one, and
the same functions (metrics, PNG, Chrome trace) consume both."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipewright.codec import parse_action
from pipewright.errors import PipewrightError
from pipewright.ir import Action, KindRegistry


@dataclass(frozen=True, slots=True)
class Span:
    """``action`` ran on ``rank`` from ``start`` to ``end`` seconds; ``stream`` is "compute" or "comm"."""

    rank: int
    action: Action
    start: float
    end: float
    stream: str = "compute"
    iteration: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Spans of one or more iterations on ``num_ranks`` ranks. ``source``: "simulated" or "measured"."""

    num_ranks: int
    spans: tuple[Span, ...]
    source: str = "simulated"
    meta: dict = field(default_factory=dict)

    @classmethod
    def of(cls, num_ranks: int, spans: Iterable[Span], **kwargs) -> Timeline:
        return cls(num_ranks, tuple(sorted(spans, key=lambda s: (s.rank, s.start, s.end))), **kwargs)

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def rank_spans(self, rank: int, stream: str | None = "compute") -> list[Span]:
        return [s for s in self.spans if s.rank == rank and (stream is None or s.stream == stream)]

    def busy(self, rank: int) -> float:
        """Time the rank's compute stream is occupied (overlapping spans counted once)."""
        total, cur_start, cur_end = 0.0, None, None
        for s in sorted(self.rank_spans(rank), key=lambda s: s.start):
            if cur_end is None or s.start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s.start, s.end
            else:
                cur_end = max(cur_end, s.end)
        if cur_end is not None:
            total += cur_end - cur_start
        return total

    def bubble(self, rank: int, period: float | None = None) -> float:
        """Idle compute time of ``rank`` within ``period`` (default: the whole makespan)."""
        return (self.makespan if period is None else period) - self.busy(rank)

    def bubble_fraction(self) -> float:
        """Idle over total: Σ_r bubble_r / (ranks × makespan)."""
        if not self.spans or self.makespan <= 0:
            return 0.0
        return sum(self.bubble(r) for r in range(self.num_ranks)) / (self.num_ranks * self.makespan)

    def to_json(self) -> dict:
        return {
            "num_ranks": self.num_ranks,
            "source": self.source,
            "meta": self.meta,
            "spans": [[s.rank, str(s.action), s.start, s.end, s.stream, s.iteration] for s in self.spans],
        }

    @classmethod
    def from_json(cls, data: dict, kinds: KindRegistry | None = None) -> Timeline:
        """Inverse of :meth:`to_json`; ``kinds`` names extension kinds the spans may hold. Malformed
        data is a one-line PipewrightError."""
        try:
            spans = [
                Span(int(r), parse_action(str(a), kinds), float(st), float(en), str(stream), int(it))
                for r, a, st, en, stream, it in data["spans"]
            ]
            if not isinstance(data["num_ranks"], int) or not isinstance(data.get("meta", {}), dict):
                raise TypeError("num_ranks must be an integer and meta an object")
            for sp in spans:
                if not (0 <= sp.rank < data["num_ranks"] and 0.0 <= sp.start <= sp.end < float("inf")):
                    raise ValueError(f"span {sp.action} of rank {sp.rank} outside the ranks or time")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise PipewrightError(
                "not a timeline: expected {num_ranks, spans: [[rank, action, start, end, stream, "
                f"iteration], ...]}} ({type(exc).__name__})"
            ) from None
        return cls.of(
            data["num_ranks"],
            spans,
            source=data.get("source", "simulated"),
            meta=data.get("meta", {}),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))
