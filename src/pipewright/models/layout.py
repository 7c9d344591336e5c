"""Layouts: which layers each pipeline stage holds, written as Megatron's pipeline-layout strings.

``"E|t*4|t*4|tL"`` reads: stage 0 holds the embedding (``E``), stages 1 and 2 four transformer layers
each (``t*4``), stage 3 one transformer layer and the output layer with its loss head (``L``). ``|``
separates stages; ``X*N`` repeats a symbol N times; stages may be uneven. Transformer layers are
numbered globally in order, so a layer's identity (and its initial weights) never depends on the split.

Pure Python (no torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipewright.errors import ConfigError

_TOKEN = re.compile(r"([EtL])(?:\*(\d+))?")


@dataclass(frozen=True)
class StageLayout:
    """One stage: the embedding?, the global indices of its transformer layers, the output layer?"""

    embedding: bool
    layers: tuple[int, ...]
    head: bool

    def __str__(self) -> str:
        n = len(self.layers)
        body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
        return ("E" if self.embedding else "") + body + ("L" if self.head else "")


@dataclass(frozen=True)
class Layout:
    """The stages of a pipeline, in order (stage index = position)."""

    stages: tuple[StageLayout, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return sum(len(s.layers) for s in self.stages)

    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Transformer layers per stage (what the cost models take as a layout)."""
        return tuple(len(s.layers) for s in self.stages)

    def __str__(self) -> str:
        return "|".join(map(str, self.stages))

    def check(self, num_layers: int, num_stages: int | None = None) -> Layout:
        """Raise a one-line ConfigError unless the layout fits a model of ``num_layers`` layers (and,
        when given, a pipeline of ``num_stages`` stages = pp × virtual)."""
        if self.num_layers != num_layers:
            raise ConfigError(
                f"layout {self} holds {self.num_layers} transformer layers but the model has {num_layers}; "
                "change --layers or the layout"
            )
        if num_stages is not None and self.num_stages != num_stages:
            raise ConfigError(
                f"layout {self} has {self.num_stages} stages but pp × virtual = {num_stages}; "
                "write one '|'-separated part per stage"
            )
        return self


def parse_layout(text: str) -> Layout:
    """Parse a Megatron-style layout string such as ``"E|t*4|t*4|tL"`` (see the module docstring).

    Rules: ``E`` only at the start of the first stage, ``L`` only at the end of the last, every stage
    non-empty, repeat counts ≥ 1. Raises a one-line ConfigError naming the problem.
    """
    parts = text.replace(" ", "").split("|")
    if not text.strip():
        raise ConfigError("empty layout; write e.g. 'Et*2|t*2L'")
    stages: list[StageLayout] = []
    next_layer = 0
    for i, part in enumerate(parts):
        if not part:
            raise ConfigError(f"layout {text!r}: stage {i} is empty; every stage needs a layer")
        pos, emb, head, n = 0, False, False, 0
        while pos < len(part):
            m = _TOKEN.match(part, pos)
            if m is None:
                raise ConfigError(
                    f"layout {text!r}: cannot read {part[pos:]!r} in stage {i}; use E, t, L, '*N' and '|'"
                )
            sym, count = m.group(1), int(m.group(2) or 1)
            if count < 1:
                raise ConfigError(f"layout {text!r}: repeat count must be at least 1 in stage {i}")
            if sym == "E":
                if i != 0 or pos != 0 or count != 1:
                    raise ConfigError(f"layout {text!r}: E (embedding) must open the first stage, once")
                emb = True
            elif sym == "L":
                if i != len(parts) - 1 or m.end() != len(part) or count != 1:
                    raise ConfigError(f"layout {text!r}: L (output layer) must close the last stage, once")
                head = True
            else:
                n += count
            pos = m.end()
        stages.append(StageLayout(emb, tuple(range(next_layer, next_layer + n)), head))
        next_layer += n
    if not stages[0].embedding or not stages[-1].head:
        raise ConfigError(f"layout {text!r}: the first stage must start with E and the last end with L")
    return Layout(tuple(stages))


def uniform_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Transformer layers per stage, as even as possible: ⌊l/n⌋ each, the first l mod n stages one
    more. The one uniform split rule (the cost models and the runtime both use it)."""
    if num_stages < 1:
        raise ConfigError(f"need at least one pipeline stage (got {num_stages})")
    if num_stages > num_layers:
        raise ConfigError(
            f"{num_stages} pipeline stages (pp × virtual) but only {num_layers} layers; "
            "lower --pp/--virtual or raise --layers"
        )
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (s < extra) for s in range(num_stages))


def uniform_layout(num_layers: int, num_stages: int) -> Layout:
    """:func:`uniform_layer_counts` as a Layout: the embedding on the first stage, the output layer on
    the last."""
    stages, start = [], 0
    counts = uniform_layer_counts(num_layers, num_stages)
    for s, n in enumerate(counts):
        stages.append(StageLayout(s == 0, tuple(range(start, start + n)), s == num_stages - 1))
        start += n
    return Layout(tuple(stages))


def resolve_layout(layout: str | Layout | None, num_layers: int, num_stages: int) -> Layout:
    """The layout to use: parse ``layout`` (string), or split uniformly when None; check it fits."""
    if layout is None or layout == "":
        return uniform_layout(num_layers, num_stages)
    parsed = parse_layout(layout) if isinstance(layout, str) else layout
    return parsed.check(num_layers, num_stages)


def resolve_stage(
    layout: Layout | str | None, num_layers: int, stage_index: int, num_stages: int | None = None
) -> StageLayout:
    """Stage ``stage_index`` of ``layout`` (a Layout, a layout string, or None for the uniform split
    over ``num_stages``), checked against ``num_layers``; one-line ConfigError otherwise."""
    if isinstance(layout, Layout):
        resolved = layout.check(num_layers)
    else:
        if layout is None and num_stages is None:
            raise ConfigError("build_stage needs a layout or num_stages")
        resolved = resolve_layout(layout, num_layers, num_stages or len(layout.split("|")))
    if not 0 <= stage_index < resolved.num_stages:
        raise ConfigError(f"stage {stage_index} does not exist in layout {resolved}")
    return resolved.stages[stage_index]
