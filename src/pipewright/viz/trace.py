"""Chrome / Perfetto trace JSON of a timeline (open in chrome://tracing or ui.perfetto.dev).

One process per rank; one thread per stream ("compute", "comm"). Spans that overlap within a stream
(concurrent transfers on different links) go to extra lanes "comm 1", "comm 2", … because the trace
format needs the events of one thread to nest. Events are complete ("X") events in microseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipewright.timeline import Span, Timeline

_STREAM_ORDER = {"compute": 0, "comm": 1}


def trace_events(timeline: Timeline) -> list[dict]:
    """The trace's event list: metadata (process and thread names) then one "X" event per span."""
    events: list[dict] = []
    lanes: dict[tuple[int, str], list[float]] = {}  # (rank, stream) -> end time of each lane
    threads: dict[tuple[int, str, int], int] = {}
    for span in sorted(timeline.spans, key=lambda s: (s.rank, _STREAM_ORDER.get(s.stream, 2), s.start)):
        ends = lanes.setdefault((span.rank, span.stream), [])
        lane = next((i for i, e in enumerate(ends) if e <= span.start), len(ends))
        if lane == len(ends):
            ends.append(span.end)
        else:
            ends[lane] = span.end
        key = (span.rank, span.stream, lane)
        tid = threads.setdefault(key, len([k for k in threads if k[0] == span.rank]))
        events.append(_event(span, tid))
    meta = [
        {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        for r in range(timeline.num_ranks)
    ]
    for (rank, stream, lane), tid in threads.items():
        name = stream if lane == 0 else f"{stream} {lane}"
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        meta.append(
            {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
        )
    return meta + events


def _event(span: Span, tid: int) -> dict:
    a = span.action
    return {
        "name": str(a),
        "cat": a.kind,
        "ph": "X",
        "ts": span.start * 1e6,
        "dur": (span.end - span.start) * 1e6,
        "pid": span.rank,
        "tid": tid,
        "args": {"stage": a.stage, "microbatch": a.microbatch, "iteration": span.iteration},
    }


def write_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write ``timeline`` as a Chrome/Perfetto trace JSON file."""
    out = Path(path)
    doc = {
        "traceEvents": trace_events(timeline),
        "displayTimeUnit": "ms",
        "otherData": {"source": timeline.source, **{k: str(v) for k, v in timeline.meta.items()}},
    }
    out.write_text(json.dumps(doc))
    return out
