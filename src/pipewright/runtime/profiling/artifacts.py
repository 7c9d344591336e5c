"""A run's files on rank 0: ``metrics.jsonl`` (one JSON object per step) with the progress bar, and at
the end ``loss.png``, ``timeline.png`` (the measured timeline of the last step), ``trace.json`` and
``timeline.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipewright.runtime.profiling.progress_log import progress, strict_json
from pipewright.timeline import Timeline
from pipewright.viz.loss import plot_loss
from pipewright.viz.timeline_figure import draw_timeline
from pipewright.viz.trace import write_trace


class MetricsWriter:
    """Rank 0's ``metrics.jsonl`` (one JSON object per step) and progress bar."""

    def __init__(self, run: Any, start: int, tokens_per_step: int) -> None:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = run.out_dir / "metrics.jsonl"
        kept: list[str] = []
        if start > 0 and self.path.is_file():  # resuming: keep the steps before the checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] < start]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        (run.out_dir / "config.json").write_text(json.dumps(run.config.flat(), indent=1, default=str))
        self.progress = None
        if run.config.progress:  # a bar on a terminal, plain lines in a log (progress_log.py)
            self.progress = progress(run.config.steps, start)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(strict_json(record) + "\n")  # NaN/inf as null
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            self.progress.update(1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def write_artifacts(run: Any, timeline: Timeline | None) -> dict[str, Path]:
    """loss.png from metrics.jsonl; timeline.png, trace.json and timeline.json (:meth:`Timeline.save`) from
    the last step's measured timeline."""
    out_dir = run.out_dir
    files = {"loss_png": out_dir / "loss.png"}
    plot_loss(out_dir / "metrics.jsonl", files["loss_png"])
    if timeline is not None:
        files["timeline_png"] = out_dir / "timeline.png"
        files["trace"] = out_dir / "trace.json"
        c = run.config
        title = (
            f"measured: {run.schedule.name}, tp={c.tp} cp={c.cp} pp={c.pp} dp={c.dp} "
            f"stages={run.schedule.num_stages}, "
            f"m={c.microbatches}, last step"
        )
        draw_timeline([timeline], files["timeline_png"], titles=[title])
        write_trace(timeline, files["trace"])
        files["timeline"] = out_dir / "timeline.json"
        timeline.save(files["timeline"])
    return files
