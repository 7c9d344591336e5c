"""Pure functions Schedule → Schedule (lowering, vocabulary, bubble filling) and the validator."""

from pipewright.passes.lower import lower
from pipewright.passes.validate import validate

__all__ = ["lower", "validate"]
