"""Features own their options: one dataclass section gives a feature's TOML table, its ``train`` flags
(one argument group, defaults shown) and the values its plugin reads; TrainConfig keeps them in the
feature's own section (by feature name) and records them under the flags' names, and an option nobody
declares is a one-line error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipewright.errors import ConfigError
from pipewright.features.async_weights.options import AsyncOptions
from pipewright.features.kfac.options import KfacOptions
from pipewright.options import flat_defaults, read_section, take_values, update_rule_names
from pipewright.training import check_config, config_from_toml, config_from_values


def test_a_section_names_its_options_by_flag() -> None:
    assert flat_defaults(KfacOptions) == {
        "kfac_base": "adamw",
        "kfac_fill": "measured",
        "kfac_opportunistic": False,
    }
    assert flat_defaults(AsyncOptions) == {"weight_policy": "stash", "async_window": 10}
    assert update_rule_names(KfacOptions) == ("kfac_base",)


@given(
    window=st.integers(1, 1000),
    policy=st.sampled_from(["none", "stash", "2bw"]),
    by_table=st.booleans(),
    dashes=st.booleans(),
)
def test_table_keys_and_flat_names_read_alike(window: int, policy: str, by_table: bool, dashes: bool) -> None:
    if by_table:
        values = {
            "async.window": window,
            ("async.weight-policy" if dashes else "async.weight_policy"): policy,
        }
    else:
        values = {"async_window": window, ("weight-policy" if dashes else "weight_policy"): policy}
    mine, rest = take_values(AsyncOptions, "async", {**values, "other": 1})
    assert mine == {"async_window": window, "weight_policy": policy} and rest == {"other": 1}
    assert read_section(AsyncOptions, mine) == AsyncOptions(weight_policy=policy, window=window)


def test_toml_tables_reach_the_config(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[train]\noptimizer = "kfac"\n\n[kfac]\nbase = "lamb"\n\n[vocab]\nparallel = "alg1"\n')
    config = check_config(config_from_toml(path))
    kfac, vocab = config.features["kfac"], config.features["vocab"]
    assert (kfac.base, kfac.fill, vocab.parallel) == ("lamb", "measured", "alg1")
    assert config.flat()["kfac_base"] == "lamb" and "features" not in config.flat()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kfac_bsae": "sgd"}, "unknown key 'kfac_bsae'"),
        ({"kfac.nope": 1}, "unknown key 'kfac.nope'"),
        ({"async_window": "ten"}, "window must be an integer"),
    ],
)
def test_unknown_or_mistyped_options_are_one_line(values, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_from_values(values)
    assert "\n" not in str(info.value)


def test_train_help_is_grouped_with_defaults(capsys) -> None:
    from pipewright.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    groups = ["model:", "parallelism:", "schedule:", "batch:", "precision:", "memory:", "training:"]
    groups += ["training.checkpoints:", "output:", "vocab:", "kfac:", "async_weights:"]  # the spec's sections
    positions = [text.index("\n" + g) for g in groups]
    assert positions == sorted(positions)
    assert "--steps STEPS         training steps (default: 200)" in text
    assert "--async-window WINDOW" in text and "(default: 10)" in text
