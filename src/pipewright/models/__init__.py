"""Model descriptions (pure Python) and, in ``gpt.py``, the PyTorch model."""

from pipewright.models.spec import ModelSpec

__all__ = ["ModelSpec"]
