"""``train``'s inputs as one RunSpec (training/run_inputs.py): the command's defaults, an older
``[train]`` TOML, a plan's values, then what the run sets itself (the flags, a RunSpec file's values
that differ from the defaults); each TrainConfig field is the value at its spec path."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipewright.cli import build_parser as _build
from pipewright.cli.train import config_from_args
from pipewright.errors import ConfigError
from pipewright.models.presets import resolve_model
from pipewright.plan.planfile import FORMAT, model_json, save

build_parser = functools.cache(_build)  # one parser for the module's command lines

#: (TrainConfig field, flag, spec path) of a few numbers every layer can set.
FIELDS = (
    ("steps", "--steps", ("training", "steps")),
    ("warmup", "--warmup", ("training", "warmup")),
    ("seed", "--seed", ("training", "seed")),
    ("eval_every", "--eval-every", ("training", "checkpoints", "eval_every")),
)


def _layered(tmp_path, toml: dict, flags: dict, runspec: dict):
    args = ["train"]
    if toml:
        path = tmp_path / "old.toml"
        path.write_text("".join(f"{k} = {v}\n" for k, v in toml.items()))
        args += ["--config", str(path)]
    elif runspec:
        path = tmp_path / "run.toml"
        tables: dict[str, list[str]] = {}
        for name, value in runspec.items():
            path_ = next(p for n, _, p in FIELDS if n == name)
            tables.setdefault(".".join(path_[:-1]), []).append(f"{path_[-1]} = {value}")
        path.write_text("".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items()))
        args += ["--config", str(path)]
    for name, value in flags.items():
        args += [next(f for n, f, _ in FIELDS if n == name), str(value)]
    return config_from_args(build_parser().parse_args(args))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_flags_over_the_file_over_the_defaults(tmp_path_factory, data):
    """Each value is the flag's if given, else the file's (an older TOML or a RunSpec), else train's
    default."""
    names = [n for n, _, _ in FIELDS]
    value = st.integers(1, 500)
    in_file = data.draw(st.dictionaries(st.sampled_from(names), value), label="file")
    flags = data.draw(st.dictionaries(st.sampled_from(names), value), label="flags")
    older = data.draw(st.booleans(), label="older TOML")
    tmp = tmp_path_factory.mktemp("layers")
    config = _layered(tmp, in_file if older else {}, flags, {} if older else in_file)
    default = config_from_args(build_parser().parse_args(["train"]))
    for name in names:
        want = flags.get(name, in_file.get(name, getattr(default, name)))
        assert getattr(config, name) == want, name


@pytest.fixture
def plan_file(tmp_path):
    spec = resolve_model("gpt-small-cpu", layers=8)
    data = {"format": FORMAT, "model": model_json(spec), "tp": 1, "pp": 4, "dp": 1, "virtual": 1,
            "schedule": "gpipe", "microbatches": 16, "microbatch_size": 1, "sequence_parallel": False,
            "layout": "Et*3|t*2|t*2|tL", "devices": []}  # fmt: skip
    save(data, tmp_path / "plan.json")
    return tmp_path / "plan.json"


def test_a_plan_is_over_an_older_file_and_under_the_flags(tmp_path, plan_file):
    old = tmp_path / "old.toml"
    old.write_text('[train]\nsteps = 3\npp = 2\nschedule = "1f1b"\nvocab_parallel = "alg1"\n')
    argv = ["train", "--config", str(old), "--plan", str(plan_file), "--microbatches", "8"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.steps, config.pp, config.schedule, config.layout) == (3, 4, "gpipe", "Et*3|t*2|t*2|tL")
    assert (config.microbatches, config.layers, config.dp) == (8, 8, 1)  # dp: the plan's, not the processes'
    assert config.features["vocab"].parallel == "alg1"
    with pytest.raises(ConfigError, match="made for a model with layers 8, not 6"):
        config_from_args(build_parser().parse_args(["train", "--plan", str(plan_file), "--layers", "6"]))


def test_an_unknown_key_of_an_older_file_is_one_line(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[train]\nsteps = 3\nvocab_paralel = 'alg1'\n")
    with pytest.raises(ConfigError, match="unknown key 'vocab_paralel'") as info:
        config_from_args(build_parser().parse_args(["train", "--config", str(old)]))
    assert "\n" not in str(info.value)


def test_values_by_flag_name_change_only_what_they_name():
    from pipewright.training import config_from_values, replaced

    config = config_from_values({"kfac_base": "lamb", "vocab.parallel": "alg1", "async-window": 3})
    kfac, vocab, window = config.features["kfac"], config.features["vocab"], config.features["async_weights"]
    assert (kfac.base, vocab.parallel, window.window) == ("lamb", "alg1", 3)
    assert replaced(config, pp=4).features == config.features
    changed = replaced(config, kfac_fill="all").features["kfac"]
    assert (changed.base, changed.fill) == ("lamb", "all")
