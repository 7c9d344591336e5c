"""Where the model's parts run, as the cost models read it from the layout.

A layout is either a :class:`pipewright.models.layout.Layout` — each stage says whether it holds the
embedding (``E``), which transformer layers, and whether it holds the output layer with its loss
(``L``) — or just the number of transformer layers per stage, with the embedding on the first stage
and the output layer on the last (Megatron's default). A feature that moves the vocabulary layers
(vocabulary parallelism) gives a Layout whose stages hold neither and prices its own kinds.
"""

from __future__ import annotations

from typing import Any

from pipewright.errors import ConfigError
from pipewright.models.layout import uniform_layer_counts as uniform_counts


def layer_counts(layout: Any, layers: int, num_stages: int) -> tuple[int, ...]:
    """Transformer layers per stage of ``layout`` (a Layout, counts, or None = uniform); one-line error
    when it does not give ``num_stages`` stages summing to ``layers``."""
    if layout is None:
        return uniform_counts(layers, num_stages)
    counts = tuple(len(s.layers) for s in layout.stages) if hasattr(layout, "stages") else tuple(layout)
    if len(counts) != num_stages or sum(counts) != layers:
        raise ConfigError(f"layout {list(counts)} must give {num_stages} stages summing to {layers} layers")
    return counts


def roles(layout: Any, stage: int, num_stages: int) -> tuple[bool, bool]:
    """(holds the embedding, holds the output layer and loss) for ``stage``."""
    if layout is not None and hasattr(layout, "stages"):
        s = layout.stages[stage]
        return bool(s.embedding), bool(s.head)
    return stage == 0, stage == num_stages - 1


def loss_stage(layout: Any, num_stages: int) -> int | None:
    """The stage that computes the loss (None when no stage holds the output layer)."""
    if layout is not None and hasattr(layout, "stages"):
        return next((i for i, s in enumerate(layout.stages) if s.head), None)
    return num_stages - 1
