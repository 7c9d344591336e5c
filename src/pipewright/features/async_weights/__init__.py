"""Asynchronous pipelines: weight policies none/stash/2bw/predict/dc for schedules without
a flush, PipeOptim's optimizer-dependent weight prediction, version differences read from the
schedule, and the weight memory of each policy. See docs/async-pipelines.md.

The feature adds no action kinds (it uses STEP inside the window) and no cost rules. Its schedules
live in ``schedules/async_variants.py``: ``async-zb-h1`` is in the default registry,
``async-interleaved-1f1b`` comes with this bundle (``FEATURE.schedules``). Its training plugin
(:class:`.trainer.AsyncPlugin`) takes part in runs of schedules without a flush: it gives the
trainer's executors a handler wrapper around their F/B/I/W/STEP handlers
(:meth:`.runtime.AsyncRuntime.wrap`) and runs the steps a window at a time. Its options are
:class:`.options.AsyncOptions` (TOML ``[async]``).
"""

from pipewright.features import Feature
from pipewright.features.async_weights.options import AsyncOptions
from pipewright.schedules.async_variants import ASYNC_INTERLEAVED

FEATURE = Feature(
    name="async_weights",
    schedules=(ASYNC_INTERLEAVED,),
    section=AsyncOptions,
    table="async",
    plugin="pipewright.features.async_weights.window_trainer:AsyncPlugin",
    description="asynchronous pipelines: weight stashing, 2BW, PipeOptim prediction, delay compensation",
)
