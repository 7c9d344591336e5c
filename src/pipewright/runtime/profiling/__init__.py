"""Measuring runs and machines: the per-action profiler and its message row, accelerator calibration,
measured timelines and wait clocks, the simulator-vs-measurement comparison, and a run's metrics files
and progress output."""
