"""Asynchronous pipelines: weight policies none/stash/2bw/predict/dc for schedules without
a flush, PipeOptim's optimizer-dependent weight prediction, version differences read from the
schedule, and the weight memory of each policy. See docs/async-pipelines.md.

The feature adds no action kinds (it uses STEP inside the window) and no cost rules. Its schedules
live in ``schedules/async_variants.py``: ``async-zb-h1`` is in the default registry,
``async-interleaved-1f1b`` comes with this bundle (``FEATURE.schedules``). Its training plugin
(:class:`.trainer.AsyncPlugin`) takes part in runs of schedules without a flush: it gives the
trainer's executors a handler wrapper around their F/B/I/W/STEP handlers
(:meth:`.runtime.AsyncRuntime.wrap`) and runs the steps a window at a time. Its options are
:class:`.options.AsyncOptions` (TOML ``[async]``). ``FEATURE`` (:mod:`.feature`) is imported on first
use (PEP 562): importing the package (as reading :mod:`.options` does) imports none of its modules.
"""

from pipewright.lazy import lazy_attributes

_WHERE = {"FEATURE": "pipewright.features.async_weights.feature"}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
