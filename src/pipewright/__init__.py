"""pipewright: plan, simulate and run pipeline-parallel training of transformer language models."""

from pipewright.errors import PipewrightError
from pipewright.ir import Action, KindRegistry, KindSpec, Schedule

__version__ = "0.1.0"
__all__ = ["Action", "KindRegistry", "KindSpec", "PipewrightError", "Schedule", "__version__"]
