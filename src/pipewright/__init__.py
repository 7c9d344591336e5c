"""pipewright: plan, simulate and run pipeline-parallel training of transformer language models."""

from typing import Any

from pipewright.errors import PipewrightError
from pipewright.ir import Action, KindRegistry, KindSpec, Schedule

__version__ = "0.1.0"
__all__ = [
    "Action",
    "KindRegistry",
    "KindSpec",
    "PipewrightError",
    "Schedule",
    "Tied",
    "__version__",
    "pipeline",
]


def __getattr__(name: str) -> Any:
    """``pipewright.pipeline`` and ``pipewright.Tied`` (any model as a list of layers), imported on first
    use: ``import pipewright`` stays free of torch."""
    if name in ("pipeline", "Tied"):
        from pipewright.training import layer_pipeline

        return getattr(layer_pipeline, name)
    raise AttributeError(f"module 'pipewright' has no attribute {name!r}")
