"""Megatron-Core's layout language: our expansion equals megatron-core's own parser on generated
layouts, format → parse is the identity, and bad text is a one-line error naming the column."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.errors import ConfigError
from pipewright.models.layout import Layout, StageLayout, parse_layout
from pipewright.models.layout_text import expand_layout, format_layout

mcore = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
_CHAR = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}


def megatron_stages(text: str) -> tuple[str, ...]:
    """Megatron-Core's ``parse_str_to_list``, each stage back as a symbol string."""
    rows = mcore.PipelineParallelLayerLayout.parse_str_to_list(text)
    return tuple("".join(_CHAR[layer.name] for layer in row) for row in rows)


def megatron_reads(text: str) -> tuple[str, ...] | None:
    try:
        return megatron_stages(text)
    except (AssertionError, ValueError):
        return None


_PIECE = st.sampled_from(["E", "t", "m", "L", "|", "tt", "t|"])
_REPEAT = st.one_of(st.just(""), st.integers(0, 12).map(lambda n: f"*{n}"))


@st.composite
def grammar_text(draw) -> str:
    """Text of the language: symbols and '|' with optional '*N', '(…)*N' groups, cosmetic commas."""
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            body = "".join(draw(_PIECE) + draw(_REPEAT) for _ in range(draw(st.integers(1, 3))))
            parts.append(f"({body})*{draw(st.integers(0, 5))}")
        else:
            parts.append(draw(_PIECE) + draw(_REPEAT))
        if draw(st.integers(0, 5)) == 0:
            parts.append(",")
    return "".join(parts)


@given(grammar_text())
@settings(max_examples=300, deadline=None)
def test_expansion_equals_megatron_core(text):
    assert expand_layout(text) == megatron_stages(text)


@given(st.text(alphabet="EtmL|()*0123,", max_size=16))
@settings(max_examples=400, deadline=None)
def test_what_we_read_megatron_core_reads_the_same(text):
    """On any text: an accepted layout expands as Megatron-Core's; a refused one is one line."""
    try:
        ours = expand_layout(text)
    except ConfigError as exc:
        assert "\n" not in str(exc) and "column" in str(exc)
        return
    assert ours == megatron_reads(text)


@st.composite
def layouts(draw) -> Layout:
    """Valid layouts: blocks of repeated stages (as pipelines are written), MTP layers at the end."""
    counts: list[int] = []
    while len(counts) < draw(st.integers(1, 40)):
        block = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        counts += block * draw(st.integers(1, 6))
    mtp = draw(st.integers(0, 2))
    stages, start = [], 0
    for i, n in enumerate(counts):
        first, last = i == 0, i == len(counts) - 1
        n = max(n, 0 if first or last else 1)
        stages.append(StageLayout(first, tuple(range(start, start + n)), last, mtp if last else 0))
        start += n
    return Layout(tuple(stages))


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_format_then_parse_is_the_identity(layout):
    text = layout.compact()
    assert parse_layout(text) == layout
    assert expand_layout(text) == megatron_stages(text)
    assert len(text) <= len(str(layout))


def test_llama3_405b_layout_is_short():
    """Llama 3 405B (126 layers on 128 stages: the embedding and the output layer on stages of their own)."""
    layout = parse_layout("E|" + "t|" * 126 + "L")
    assert layout.compact() == "E|(t|)*126L"
    assert parse_layout("E|(t|)*126L") == layout and layout.num_layers == 126 and layout.num_stages == 128
    assert format_layout(["Ettt", *["tt"] * 29, "m", "L"]) == "Ettt|(tt|)*29m|L"  # Megatron-Core's example


def test_megatron_core_examples():
    for text in ["Ettt|(tt|)*29,m|L", "E|(t|)*126L", "Et|(tt|)*30mL", "(Et|t)*1|(t|)*2tL"]:
        assert expand_layout(text) == megatron_stages(text)
    assert parse_layout("Et*1,2|tL").layer_counts == (12, 1)  # commas are cosmetic, digits join
    assert parse_layout("Et|(tt|)*30mL").stages[-1].mtp == 1
    assert parse_layout("Et|(tt|)*30mL").check(61, 32, mtp_depth=1).num_mtp == 1
    with pytest.raises(ConfigError, match=r"holds 1 multi-token-prediction layers \(m\) but the model has 0"):
        parse_layout("Et|(tt|)*30mL").check(61)  # an m the model lacks is refused, not ignored


@pytest.mark.parametrize(
    ("text", "column"),
    [
        ("Et*x|tL", 4),
        ("E(t|(t)*2)*2L", 5),
        ("(t)*2*3", 6),
        ("E(t|)L", 6),
        ("Et|tL)", 6),
        ("Et|t?L", 5),
        ("Et|mt|L", 5),
        ("Et|m|mL", 6),
        ("Et|t|EL", 6),
    ],
)
def test_errors_name_the_column(text, column):
    with pytest.raises(ConfigError, match=f"column {column}:") as info:
        parse_layout(text)
    assert "\n" not in str(info.value)


def test_an_empty_stage_says_why():
    with pytest.raises(ConfigError, match=r"stage 127 is empty.*already ends with '\|'"):
        parse_layout("E|(t|)*126|L")
    with pytest.raises(ConfigError, match="more than"):
        parse_layout("Et*99999999999L")
