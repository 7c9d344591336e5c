"""Pictures and traces: timelines (simulated or measured), Chrome traces and loss curves."""

from pipewright.viz.timeline_figure import draw_timeline
from pipewright.viz.trace import write_trace

__all__ = ["draw_timeline", "write_trace"]
