"""The schedule library: one module per family, looked up by name through :mod:`.registry`."""

from pipewright.schedules.registry import (
    ScheduleCosts,
    ScheduleInfo,
    ScheduleRegistry,
    build_schedule,
    default_registry,
    info,
    schedule_names,
)

__all__ = [
    "ScheduleCosts",
    "ScheduleInfo",
    "ScheduleRegistry",
    "build_schedule",
    "default_registry",
    "info",
    "schedule_names",
]
