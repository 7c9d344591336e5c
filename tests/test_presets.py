"""Model presets and family resolution."""

import pytest

from pipewright.errors import ConfigError
from pipewright.models.presets import get_preset, preset_names, resolve_model


def test_presets():
    t = get_preset("megatron-1t")
    assert (t.layers, t.hidden, t.heads, t.vocab, t.seq_len) == (128, 25600, 160, 51200, 2048)
    g = get_preset("gpt3-175b")
    assert (g.layers, g.hidden, g.heads) == (96, 12288, 96)
    assert get_preset("bert-large").family == "bert"
    tiny = get_preset("gpt-tiny")
    assert (tiny.layers, tiny.hidden, tiny.heads, tiny.vocab, tiny.seq_len) == (4, 64, 4, 256, 64)
    assert len([n for n in preset_names() if n.startswith("megatron-")]) == 10
    assert all(get_preset(n).hidden % get_preset(n).heads == 0 for n in preset_names())


def test_overrides_keep_ffn_at_4h():
    spec = resolve_model("gpt-tiny", hidden=128, layers=None)
    assert (spec.hidden, spec.ffn_hidden, spec.layers) == (128, 512, 4)
    assert resolve_model("bert-base", seq_len=128).seq_len == 128


def test_family_needs_all_dimensions():
    spec = resolve_model("gpt", layers=2, hidden=32, heads=2, vocab=50, seq_len=16)
    assert spec.ffn_hidden == 128 and spec.family == "gpt"
    with pytest.raises(ConfigError, match="model family 'bert' needs --hidden --seq-len"):
        resolve_model("bert", layers=2, heads=2, vocab=50)


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as err:
        resolve_model("gpt-3")
    assert "gpt3-175b" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_model("gpt-tiny", heads=3)
