"""The data layer's user error."""

from __future__ import annotations

from pipewright.errors import PipewrightError


class DataError(PipewrightError):
    """A dataset, token file, tokenizer spec or metrics file cannot be used; the message names it."""
