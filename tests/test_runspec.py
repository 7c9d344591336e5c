"""RunSpec: spec → TOML → spec and spec → flags → spec unchanged for random valid specs of every
command; every command's parser is the spec's; a flag left out is the default its help shows (train's:
the training config's); the flags and the file offer the same choices; help groups of at most 15
flags, each line with its default; one-line errors."""

from __future__ import annotations

import argparse
import functools
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
from pipewright.runspec.fields import COMMANDS
from pipewright.runspec.flags import MAX_GROUP
from pipewright.runspec.run import get

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def spec_parser(command: str) -> argparse.ArgumentParser:
    from pipewright.cli._help import Parser

    parser = Parser(prog=f"pipewright {command}")
    add_spec_flags(parser, command)
    return parser


@functools.cache
def cli_parser(command: str) -> argparse.ArgumentParser:
    """The command's parser as the command line builds it (``schedule show``: the verb's)."""
    from pipewright.cli import build_parser
    from pipewright.cli._help import parsers

    return dict(parsers(build_parser(command=command.split()[0])))[tuple(command.split())]


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if a.dest != "help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_the_specs(command):
    """The command line declares no flag of its own: each command's flags are the spec's, under their
    fields' paths."""
    built = cli_parser(command)
    assert options(built) == options(spec_parser(command))
    assert {a.dest for a in built._actions} == {a.dest for a in spec_parser(command)._actions} | {"help"}


def _train_field(path, f) -> str | None:
    """TrainConfig's field of spec field ``path`` (named as the field, the field plus ``_s``, or as
    the flag), else None."""
    from dataclasses import fields

    from pipewright.runtime.setup.config import TrainConfig

    names = {x.name for x in fields(TrainConfig)}
    flat = f.metadata["flag"].lstrip("-").replace("-", "_")
    return next((n for n in (path[-1], f"{path[-1]}_s", flat) if n in names), None)


@pytest.mark.parametrize("command", ("train", "check"))
def test_trains_defaults_are_the_training_configs(command):
    """A training flag left out leaves TrainConfig's default (the command passes None), so the default
    its help shows (the spec's) must be TrainConfig's."""
    from dataclasses import asdict

    from pipewright.runspec.run import feature_sections, field_takes, spec_fields
    from pipewright.runtime.setup.config import TrainConfig

    config, spec = asdict(TrainConfig()), defaults(command)
    matched = 0
    for path, f, _ in spec_fields(feature_sections()):
        name = _train_field(path, f) if field_takes(path, f, command) else None
        if name is not None:
            today = tuple(config[name]) if isinstance(config[name], list) else config[name]
            assert get(spec, path) == today, (path, name)
            matched += 1
    assert matched > 50


@pytest.mark.parametrize("command", COMMANDS)
def test_a_flag_left_out_is_its_shown_default(command):
    """Parsing no flag gives the command's defaults, and each flag's help shows that default (where
    the field's help does not state it in its own words: ``the preset's``)."""
    from pipewright.runspec.fields import setting
    from pipewright.runspec.flags import _shown, switch_clears
    from pipewright.runspec.run import feature_sections, field_command, spec_fields

    fields = {".".join(p): (p, f) for p, f, _ in spec_fields(feature_sections())}
    parser = spec_parser(command)
    spec = defaults(command)
    assert spec_from_args(parser.parse_args([]), command, check=False) == spec
    for action in parser._actions:
        if action.dest not in fields:
            continue
        path, f = fields[action.dest]
        own = setting(f, field_command(path, command), "help") or ""
        if "default" in own.lower():
            continue
        value = get(spec, path)
        if isinstance(value, bool):
            flag = action.option_strings[0]
            shown = "on" if value != switch_clears(path, flag) else "off"
        else:
            shown = _shown(value)
        assert action.help.endswith(f"(default: {shown})"), (command, action.dest, action.help)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flags_and_the_file_offer_the_same_choices(command):
    """A closed choice: the flag offers the field's choices, and a file with another value is refused
    in one line naming them."""
    from pipewright.runspec.fields import choices, setting
    from pipewright.runspec.run import feature_sections, field_command, spec_fields

    fields = {".".join(p): (p, f, k) for p, f, k in spec_fields(feature_sections())}
    offered = [a for a in spec_parser(command)._actions if a.choices and a.dest in fields]
    for action in offered:
        path, f, kind = fields[action.dest]
        listed = setting(f, field_command(path, command), "choices") or choices(kind)
        assert tuple(action.choices) == tuple(listed), action.dest
        if listed == choices(kind):  # (a command's narrower variant is its own check's)
            table, key = ".".join(path[:-1]), path[-1]
            with pytest.raises(ConfigError, match=f"{'.'.join(path)} .*must be one of") as info:
                loads_toml(f'[{table}]\n{key} = "no-such-choice"\n', command)
            assert "\n" not in str(info.value)
    if command in ("simulate", "train"):
        assert len(offered) > 5


@pytest.mark.parametrize("command", COMMANDS)
def test_help_groups_are_small_and_show_every_default(command):
    parser = cli_parser(command)
    for group in parser._action_groups:
        assert len(group._group_actions) <= MAX_GROUP, group.title
        for action in group._group_actions:
            if action.dest != "help":
                assert "default" in action.help.lower(), (command, action.option_strings)
    assert [g.title for g in parser._action_groups if g._group_actions][1:] == [
        g.title for g in spec_parser(command)._action_groups if g._group_actions
    ][1:]  # grouped by the spec's sections (after argparse's own "options")
    if command == "train":  # train's defaults are the runnable CPU run's, shown as such
        pp = next(a for a in parser._actions if "--pp" in a.option_strings)
        assert pp.help == "pipeline-parallel size (default: 2)"


def test_the_programs_own_flags_show_their_defaults():
    """``pipewright --help``: the flags before the command (the generator's too)."""
    from pipewright.cli import build_parser

    top = build_parser(command="schedule")
    verbose = next(a for a in top._actions if "--verbose" in a.option_strings)
    assert verbose.help.endswith("(default: off)") and "--version" in options(top)


@pytest.mark.parametrize(
    "command", ("simulate", "plan", "train", "check", "profile", "schedule export", "data prepare")
)
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


def test_the_default_feature_sections_are_the_builtin_bundles():
    """The run spec's default sections (read from the registry, no bundle loaded) are the built-in
    bundles' sections, with their descriptions as the help groups' titles."""
    from pipewright.features import builtin_features
    from pipewright.runspec.run import DESCRIPTIONS, feature_sections

    bundles = builtin_features()
    assert feature_sections() == feature_sections(bundles)
    assert {f.section: f.description for f in bundles} == {
        s: DESCRIPTIONS[s] for s in feature_sections().values()
    }


def test_reading_the_default_sections_loads_no_feature():
    """A RunSpec's defaults import the features' options modules and nothing else of a feature, and no
    layer above the run spec (a fresh interpreter: what ``import`` really runs, package ``__init__``
    files included)."""
    import subprocess
    import sys

    code = (
        "import sys; from pipewright.runspec import defaults; defaults('train'); "
        "print(' '.join(m for m in sys.modules if m.startswith('pipewright.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    above = ("cost", "sim", "plan", "runtime", "training", "measure", "cli", "schedules", "passes")
    bad = [
        m
        for m in loaded.stdout.split()
        if m.split(".")[1] in above
        or (m.startswith("pipewright.features.") and m.count(".") > 2 and not m.endswith(".options"))
    ]
    assert not bad, bad


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


@pytest.mark.parametrize(
    ("argv", "values"),
    [
        (
            ["schedule", "show", "zb-h1", "--stages", "4", "-m", "6", "--with-comms"],
            {("schedule", "name"): "zb-h1", ("parallelism", "pp"): 4, ("batch", "microbatches"): 6}
            | {("schedule_view", "with_comms"): True},
        ),
        (
            ["schedule", "export", "1f1b", "-p", "2", "-m", "4", "-o", "x.csv", "--overwrite"],
            {("schedule", "name"): "1f1b", ("parallelism", "pp"): 2, ("batch", "microbatches"): 4}
            | {("output", "out"): "x.csv", ("output", "overwrite"): True},
        ),
        (
            ["data", "prepare", "a.txt", "corpus", "--tokenizer", "model", "--output", "t.bin"],
            {("data_prep", "inputs"): ("a.txt", "corpus"), ("data_prep", "tokenizer"): "model"}
            | {("output", "out"): "t.bin"},
        ),
    ],
)
def test_the_schedule_and_data_verbs_read_their_line_as_the_spec(argv, values):
    """``schedule show|export`` and ``data prepare`` read the RunSpec's sections: the parsed line is
    the spec with the flags' values under their fields and the paths given, nothing by option name."""
    from pipewright.cli import build_parser
    from pipewright.runspec.run import get

    parsed = vars(build_parser().parse_args(argv))
    assert set(parsed) == {"verbose", "command", "verb", "func", "spec", "given"}
    assert parsed["given"] == set(values)
    assert {path: get(parsed["spec"], path) for path in values} == values


def test_schedule_show_reads_a_run_spec(tmp_path, capsys):
    """``schedule show --config`` shows the file's schedule; a value in neither the flags nor the file
    is argparse's one-line usage error."""
    from pipewright.cli import main

    path = tmp_path / "run.toml"
    path.write_text('[parallelism]\npp = 4\n[batch]\nmicrobatches = 6\n[schedule]\nname = "zb-h1"\n')
    assert main(["schedule", "show", "--config", str(path)]) == 0
    assert capsys.readouterr().out.startswith("zb-h1: p=4 ranks, 4 stages, m=6 microbatches")
    with pytest.raises(SystemExit) as exited:
        main(["schedule", "show", "1f1b", "-p", "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "required: --microbatches" in err
