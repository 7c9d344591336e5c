"""The asynchronous-weights bundle (:class:`pipewright.features.Feature`): the schedule it adds, its
options and its training plugin (imported by name when used)."""

from pipewright.features.async_weights.options import AsyncOptions
from pipewright.features.bundle import Feature
from pipewright.runspec.feature_registry import BUILTIN_SECTIONS
from pipewright.schedules.async_variants import ASYNC_INTERLEAVED

FEATURE = Feature(
    name="async_weights",
    schedules=(ASYNC_INTERLEAVED,),
    section=AsyncOptions,
    table="async",
    plugin="pipewright.features.async_weights.window_trainer:AsyncPlugin",
    description=BUILTIN_SECTIONS["async_weights"].description,
)
