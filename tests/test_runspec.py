"""RunSpec: spec → TOML → spec and spec → flags → spec unchanged for random valid specs of every
command; the generated parsers take every flag today's commands take; help groups of at most 15
flags, each line with its default; one-line errors."""

from __future__ import annotations

import argparse
import functools
import importlib
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _runspec_strategies import specs
from pipewright.errors import ConfigError
from pipewright.runspec import (
    add_spec_flags,
    defaults,
    dump_toml,
    loads_toml,
    spec_from_args,
    spec_to_argv,
    validate,
)
from pipewright.runspec.flags import MAX_GROUP
from pipewright.runspec.run import get

COMMANDS = ("simulate", "plan", "train", "check", "export-plan", "profile", "calibrate")
_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def spec_parser(command: str) -> argparse.ArgumentParser:
    from pipewright.cli._help import Parser

    parser = Parser(prog=f"pipewright {command}")
    add_spec_flags(parser, command)
    return parser


@functools.cache
def todays_parser(command: str) -> argparse.ArgumentParser:
    """The command's parser as cli/ builds it today."""
    top = argparse.ArgumentParser()
    sub = top.add_subparsers()
    module = importlib.import_module(f"pipewright.cli.{command.replace('-', '_')}")
    module.register(sub, ()) if command in ("train", "check") else module.register(sub)
    return sub.choices[command]


def generated(command: str) -> bool:
    """Whether the command's parser is already the spec's (its destinations are the fields' paths)."""
    return any("." in a.dest for a in todays_parser(command)._actions)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if a.dest != "help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_spec_takes_every_flag_of_todays_command(command):
    """The check that wiring the spec into the commands loses no flag."""
    missing = options(todays_parser(command)) - options(spec_parser(command))
    assert not missing, f"{command}: no field for {sorted(missing)}"


@functools.cache
def _train_defaults() -> dict:
    from pipewright.cli import _train_defaults as defaults_by_dest

    return defaults_by_dest()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_keeps_todays_default(command):
    """A flag left out means what it means today (``train``'s None: TrainConfig's default)."""
    if generated(command):
        pytest.skip("the command's flags are the spec's")
    by_option = {o: a.dest for a in spec_parser(command)._actions for o in a.option_strings}
    spec = defaults(command)
    for action in todays_parser(command)._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        path = tuple(by_option[action.option_strings[0]].split("."))
        today = action.default
        if today is None and command in ("train", "check"):
            if path[0] == "features":  # not given: the feature section's default
                continue
            today = _train_defaults().get(action.dest)
        flag = action.option_strings[0]
        if (
            isinstance(action, argparse._StoreTrueAction)
            and flag.startswith("--no-")
            and path[-1] != "no_" + flag[5:].replace("-", "_")
        ):
            today = not today  # plan's --no-progress stored no_progress; the spec stores progress
        today = tuple(today) if isinstance(today, list) else today
        assert get(spec, path) == today, (command, action.option_strings, get(spec, path), today)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_closed_choice_is_todays(command):
    """Where a flag offers choices today, the spec's field offers the same ones."""
    if generated(command):
        pytest.skip("the command's flags are the spec's")
    ours = {o: a for a in spec_parser(command)._actions for o in a.option_strings}
    for action in todays_parser(command)._actions:
        if action.choices and action.option_strings:
            mine = ours[action.option_strings[0]].choices
            assert sorted(mine) == sorted(action.choices), (command, action.option_strings)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_groups_are_small_and_show_every_default(command):
    parser = spec_parser(command)
    for group in parser._action_groups:
        assert len(group._group_actions) <= MAX_GROUP, group.title
        for action in group._group_actions:
            if action.dest != "help":
                assert "default" in action.help.lower(), (command, action.option_strings)
    if command == "train":  # train's defaults are the runnable CPU run's, shown as such
        pp = next(a for a in parser._actions if "--pp" in a.option_strings)
        assert pp.help == "pipeline-parallel size (default: 2)"


@pytest.mark.parametrize("command", ("simulate", "plan", "train", "check", "profile"))
@given(data=st.data())
@_SETTINGS
def test_spec_to_toml_and_to_flags_and_back_is_unchanged(command, data):
    spec = data.draw(specs(command), label="spec")
    argv = spec_to_argv(spec, command)
    assert spec_from_args(spec_parser(command).parse_args(argv), command) == spec, argv
    text = dump_toml(spec)
    assert loads_toml(text, command) == spec, text


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[parallelism]\npp = 8\ntp = 2\n[features.vocab]\nparallel = "alg1"\n')
    spec = spec_from_args(
        spec_parser("simulate").parse_args(["--config", str(path), "--stages", "4"]), "simulate"
    )
    assert (spec.parallelism.pp, spec.parallelism.tp, spec.features["vocab"].parallel) == (4, 2, "alg1")
    assert spec.batch.microbatches is None and defaults("train").batch.microbatches == 4


def test_one_concept_one_field():
    """``--stages``/``-p`` are ``--pp``'s old spellings on simulate: one field."""
    parser = spec_parser("simulate")
    for argv in (["--pp", "3"], ["--stages", "3"], ["-p", "3"]):
        assert spec_from_args(parser.parse_args(argv), "simulate").parallelism.pp == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[parallelism]\ntpp = 2\n", "unknown key parallelism.tpp"),
        ("[parallelism]\ntp = 'two'\n", "parallelism.tp (--tp) must be an integer"),
        ("[parallelism]\ntp = 0\n", "parallelism.tp (--tp) must be at least 1"),
        ("[memory]\nrecompute = 'most'\n", "memory.recompute (--recompute) must be one of full, selective"),
        ("[memory]\nfsdp = true\nshard_optimizer = true\n", "exclude each other"),
        ("[parallelism]\nlayout = 'E|(t|)*4|L'\n", "stage 5 is empty"),
        ("[model]\nlayers = 3\n[parallelism]\nlayout = 'E|(t|)*4L'\n", "holds 4 transformer layers"),
        (
            "[features.vocab]\nparallel = 'alg3'\n",
            "features.vocab.parallel (--vocab-parallel) must be one of",
        ),
        ("[training]\nlr = nan\n", "training.lr (--lr) must be finite"),
        ("parallelism = 3\n", "unknown key parallelism"),
        ("[model\n", "not TOML"),
    ],
)
def test_bad_files_are_one_line(text, says):
    with pytest.raises(ConfigError) as info:
        loads_toml(text, "train", source="run.toml")
    message = str(info.value)
    assert "\n" not in message and says in message and message.startswith("run.toml")


def test_a_value_no_flag_can_write_is_named():
    spec = validate(replace(defaults("train"), parallelism=defaults("simulate").parallelism))
    with pytest.raises(ConfigError, match=r"parallelism\.pp = None: --pp cannot say 'none'"):
        spec_to_argv(spec, "train")
    assert get(spec, ("features", "vocab", "parallel")) == "none"


def test_every_published_run_is_a_spec():
    """The package's published-run specs are what the generator makes of the CSV's rows (they cannot
    drift), each reads back as the row's spec, and round-trips spec → TOML → spec and spec → flags →
    spec unchanged."""
    from pipewright.cost.fidelity import load_runs
    from pipewright.cost.published_specs import COMMAND, run_spec, spec_files, spec_name, spec_text

    parser = spec_parser(COMMAND)
    runs = load_runs()
    folder = spec_files()
    shipped = {f.name for f in folder.iterdir() if f.name.endswith(".toml")}
    assert shipped == {spec_name(run.id) for run in runs}, "run tools/fidelity.py --write-specs"
    for run in runs:
        text = spec_text(run)
        assert folder.joinpath(spec_name(run.id)).read_text(encoding="utf-8") == text, run.id
        spec = loads_toml(text, COMMAND)
        assert spec == run_spec(run), run.id
        assert spec_from_args(parser.parse_args(spec_to_argv(spec, COMMAND)), COMMAND) == spec, run.id
        assert loads_toml(dump_toml(spec), COMMAND) == spec, run.id
    assert len(runs) > 100


def test_switches_named_as_their_field_set_it():
    """``--no-step-barrier`` sets ``simulation.no_step_barrier`` (the field is named as the flag);
    ``--no-progress`` clears ``output.progress``."""
    parser = spec_parser("simulate")
    spec = spec_from_args(parser.parse_args(["--no-step-barrier", "--no-bias"]), "simulate")
    assert spec.simulation.no_step_barrier is True and spec.model.no_bias is True
    assert spec_to_argv(spec, "simulate") == ["--no-bias", "--no-step-barrier"]
    plan = spec_from_args(spec_parser("plan").parse_args(["--no-progress"]), "plan")
    assert plan.output.progress is False
    assert "--no-step-barrier" in parser.format_help()


def test_every_training_config_field_has_a_place():
    """TrainConfig's fields: each the value of a spec field that train takes (a flag of its parser) or
    a TOML-only one; train's defaults as a TrainConfig are TrainConfig's defaults."""
    from dataclasses import fields

    from pipewright.runspec.run import field_takes, spec_fields
    from pipewright.runtime.setup.config import TrainConfig

    places = {path: f for path, f, _ in spec_fields({})}
    for f in fields(TrainConfig):
        if f.name != "features":
            spec_field = places[f.metadata["path"]]
            assert field_takes(f.metadata["path"], spec_field, "train") or spec_field.metadata["flag"] is None
    assert TrainConfig.from_spec(defaults("train")) == TrainConfig(features=defaults("train").features)
