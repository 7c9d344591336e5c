"""Strict JSON metrics (NaN/inf as null) and the progress report: a bar on a terminal, plain lines in a
log; profiles checked for completeness; the timeline PNG says what its numbers are."""

from __future__ import annotations

import io
import json

import pytest

from pipewright.cost.profiled import ProfileRow, check_complete, load_profile, write_profile_csv
from pipewright.errors import ConfigError
from pipewright.runtime.profiling.progress_log import PlainProgress, progress, strict_json


def test_metrics_are_strict_json() -> None:
    line = strict_json(
        {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "x": [float("-inf"), 1.5]}
    )
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}")) == {
        "step": 1,
        "loss": None,
        "grad_norm": None,
        "x": [None, 1.5],
    }


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_only_on_a_terminal() -> None:
    log = io.StringIO()
    bar = progress(40, 0, stream=log)
    assert isinstance(bar, PlainProgress)
    for k in range(40):
        bar.set_postfix(loss=f"{5 - k / 10:.3f}")
        bar.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 20  # every 40 // 20 = 2 steps
    assert lines[-1] == "train: step 40/40, loss 1.100"
    assert not isinstance(progress(40, 0, stream=_Tty()), PlainProgress)


def _rows(drop: tuple[str, str] | None = None) -> list[ProfileRow]:
    rows = [
        ProfileRow(t, 1, k, 0.001)
        for t in ("embedding", "layer", "output")
        for k in ("F", "B")
        if (t, k) != drop
    ]
    return [*rows, ProfileRow("layer", 1, "MESSAGE", 0.0, 1024.0)]


def test_truncated_profiles_are_refused_naming_the_gap(tmp_path) -> None:
    check_complete(_rows(), "p")
    with pytest.raises(ConfigError, match="no B \\(or I and W\\) time for output at microbatch size 1"):
        check_complete(_rows(("output", "B")), "p")
    path = tmp_path / "p.csv"
    path.write_text(write_profile_csv(_rows(("layer", "F")), {"layers": 2}))
    with pytest.raises(ConfigError, match="incomplete: no F time for layer"):
        load_profile(path)


def test_timeline_png_names_microbatches_and_the_replica(tmp_path) -> None:
    from pipewright.ir import Action
    from pipewright.timeline import Span, Timeline
    from pipewright.viz import timeline_figure as viz

    tl = Timeline.of(2, [Span(0, Action(0, "F", 0), 0.0, 1.0)], source="measured", meta={"dp": 2})
    note = viz._legend_note([tl], None)
    assert "numbers in boxes: microbatch" in note and "one data-parallel replica of 2" in note
    assert viz.draw_timeline(tl, tmp_path / "t.png").stat().st_size > 0
