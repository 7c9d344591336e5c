"""Layouts: which layers each pipeline stage holds, written in Megatron-Core's pipeline-layout language
(:mod:`pipewright.models.layout_text`).

``"E|t*4|t*4|tL"`` reads: stage 0 holds the embedding (``E``), stages 1 and 2 four transformer layers
each (``t*4``), stage 3 one transformer layer and the output layer with its loss head (``L``). ``|``
separates stages; ``X*N`` repeats a symbol N times, ``(…)*N`` a piece (``E|(t*4|)*2tL`` is the same
layout); ``m`` is a multi-token-prediction layer; stages may be uneven. Transformer layers are
numbered globally in order, so a layer's identity (and its initial weights) never depends on the split.
:meth:`Layout.compact` writes a layout back with its repetition found (Llama 3 405B's 128 stages:
``E|(t|)*126L``).

Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.models.layout_text import expand_positions, format_layout


@dataclass(frozen=True)
class StageLayout:
    """One stage: the embedding?, the global indices of its transformer layers, the output layer?, and
    how many multi-token-prediction layers (``m``, after its transformer layers) it holds."""

    embedding: bool
    layers: tuple[int, ...]
    head: bool
    mtp: int = 0

    def __str__(self) -> str:
        n = len(self.layers)
        body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
        mtp = "" if self.mtp == 0 else ("m" if self.mtp == 1 else f"m*{self.mtp}")
        return ("E" if self.embedding else "") + body + mtp + ("L" if self.head else "")

    @property
    def symbols(self) -> str:
        """The stage's layer symbols, expanded (``Ettt``)."""
        return "E" * self.embedding + "t" * len(self.layers) + "m" * self.mtp + "L" * self.head


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

    def compact(self) -> str:
        """The layout's shortest text with repetition (:func:`~pipewright.models.layout_text.format_layout`):
        ``E|(t|)*126L``; :func:`parse_layout` reads it back to this layout."""
        return format_layout([s.symbols for s in self.stages])

    @property
    def num_mtp(self) -> int:
        """Multi-token-prediction layers (``m``) in the layout."""
        return sum(s.mtp for s in self.stages)

    def check(self, num_layers: int, num_stages: int | None = None, mtp_depth: int | None = 0) -> Layout:
        """Raise a one-line ConfigError unless the layout fits a model of ``num_layers`` layers (and,
        when given, a pipeline of ``num_stages`` stages = pp × virtual) with ``mtp_depth``
        multi-token-prediction layers: a layout that places them (``m``) places all of them
        (Megatron-Core's rule); one without ``m`` leaves them on the last stage, where the cost model
        prices them. ``mtp_depth`` None: not checked."""
        if mtp_depth is not None and self.num_mtp and self.num_mtp != mtp_depth:
            raise ConfigError(
                f"layout {self.compact()} holds {self.num_mtp} multi-token-prediction layers (m) but the "
                f"model has {mtp_depth} (--mtp-depth)"
            )
        if self.num_layers != num_layers:
            raise ConfigError(
                f"layout {self.compact()} holds {self.num_layers} transformer layers but the model has "
                f"{num_layers}; change --layers or the layout"
            )
        if num_stages is not None and self.num_stages != num_stages:
            raise ConfigError(
                f"layout {self.compact()} has {self.num_stages} stages but pp × virtual = {num_stages}; "
                "write one '|'-separated part per stage"
            )
        return self


def parse_layout(text: str) -> Layout:
    """Parse a layout in Megatron-Core's language such as ``"E|t*4|t*4|tL"`` or ``"E|(t|)*126L"`` (see
    the module docstring and :func:`~pipewright.models.layout_text.expand_layout`).

    Rules (Megatron-Core's, and every stage holding something): ``E`` once, opening the first stage;
    ``L`` once, closing the last; ``m`` after every ``t``, all in one stage; no empty stage. Raises a
    one-line ConfigError naming the column of the problem.
    """
    if not text.strip():
        raise ConfigError("empty layout; write e.g. 'Et*2|t*2L'")
    stages = expand_positions(text)
    first_mtp = None
    out: list[StageLayout] = []
    next_layer = 0
    for i, stage in enumerate(stages):
        if not stage:
            hint = " ('(…|)*N' already ends with '|')" if i > 0 and "(" in text else ""
            raise ConfigError(f"layout {text!r}: stage {i} is empty; every stage needs a layer{hint}")
        counts = {s: 0 for s in "EtmL"}
        for j, (symbol, col) in enumerate(stage):
            where = f"layout {text!r}, column {col}"
            if symbol == "E" and (i != 0 or j != 0 or counts["E"]):
                raise ConfigError(f"{where}: E (embedding) must open the first stage, once")
            if symbol == "L" and (i != len(stages) - 1 or j != len(stage) - 1):
                raise ConfigError(f"{where}: L (output layer) must close the last stage, once")
            if symbol == "t" and (counts["m"] or first_mtp is not None):
                raise ConfigError(f"{where}: a transformer layer after an MTP layer (m); m comes last")
            if symbol == "m":
                if first_mtp is not None and first_mtp != i:
                    raise ConfigError(f"{where}: every MTP layer (m) sits in one stage")
                first_mtp = i
            counts[symbol] += 1
        out.append(
            StageLayout(
                bool(counts["E"]),
                tuple(range(next_layer, next_layer + counts["t"])),
                bool(counts["L"]),
                counts["m"],
            )
        )
        next_layer += counts["t"]
    if not out[0].embedding or not out[-1].head:
        raise ConfigError(f"layout {text!r}: the first stage must start with E and the last end with L")
    return Layout(tuple(out))


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
