"""The schedule library: one module per family, looked up by name through :mod:`.registry`."""

from pipewright.schedules.registry import ScheduleInfo, build_schedule, info, schedule_names

__all__ = ["ScheduleInfo", "build_schedule", "info", "schedule_names"]
