"""Asynchronous pipelines: weight policies none/stash/2bw/predict/dc for schedules without
a flush, PipeOptim's optimizer-dependent weight prediction, version differences read from the
schedule, and the weight memory of each policy. See docs/async-pipelines.md.

The feature adds no action kinds (it uses STEP inside the window) and no cost rules. Its schedules
live in ``schedules/async_variants.py``: ``async-zb-h1`` is in the default registry,
``async-interleaved-1f1b`` comes with this bundle (``FEATURE.schedules``). Its ``train_runtime``
(:func:`.trainer.train_runtime`) gives the :class:`.trainer.AsyncTrainer`'s executors a handler
wrapper around their F/B/I/W/STEP handlers (:meth:`.runtime.AsyncRuntime.wrap`).
"""

from pipewright.features import Feature
from pipewright.schedules.async_variants import ASYNC_INTERLEAVED

FEATURE = Feature(
    name="async_weights",
    schedules=(ASYNC_INTERLEAVED,),
    train_runtime="pipewright.features.async_weights.trainer:train_runtime",
    training="pipewright.features.async_weights.trainer:TRAINING",
    description="asynchronous pipelines: weight stashing, 2BW, PipeOptim prediction, delay compensation",
)
