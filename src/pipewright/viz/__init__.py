"""Pictures and traces of timelines (simulated or measured)."""

from pipewright.viz.timeline import draw_timeline
from pipewright.viz.trace import write_trace

__all__ = ["draw_timeline", "write_trace"]
