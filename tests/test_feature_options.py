"""One option declaration gives the flags of ``train``, ``simulate`` and ``plan``: each field lists the
commands that take it, a command may have its own choices, help or default, and only ``train``'s
fields belong to the TOML table and the training config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipewright.cli.simulate import register as register_simulate
from pipewright.features import Feature, builtin_features
from pipewright.features.kfac.options import KfacOptions
from pipewright.features.vocab.options import CHOICES, TRAIN_CHOICES, VocabOptions
from pipewright.options import fields_for, flat_defaults, option, read_section, take_values
from pipewright.runspec import add_spec_flags, spec_from_args


@dataclass(frozen=True)
class Demo:
    level: int = option(
        2,
        "--demo-level",
        "a level",
        commands=("train", "simulate", "plan"),
        variants={"plan": {"default": 5}},
    )
    mode: str = option(
        "a", "--demo-mode", "a mode", choices=("a", "b"), variants={"train": {"choices": ("a", "b", "c")}}
    )
    only_sim: bool = option(False, "--demo-quick", "quick", commands=("simulate",))


def _parser(command: str, features: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_spec_flags(parser, command, features)
    return parser


def _parse(command: str, argv: list[str]) -> Demo:
    """The demo section of ``command``'s flags ``argv`` (through the run spec's generated flags)."""
    args = _parser(command, {"demo": Demo}).parse_args(argv)
    return spec_from_args(args, command, {"demo": Demo}, check=False).features["demo"]


def _feature_flags(command: str) -> set[str]:
    parser = _parser(command, {"demo": Demo})
    return {o for a in parser._actions if a.dest.startswith("features.demo.") for o in a.option_strings}


def test_each_command_gets_its_fields_with_its_defaults() -> None:
    assert _feature_flags("train") == {"--demo-level", "--demo-mode"}
    assert _feature_flags("simulate") == {"--demo-level", "--demo-quick"}
    assert _feature_flags("plan") == {"--demo-level"}
    assert _parse("train", []) == _parse("simulate", []) == Demo(2, "a", False)
    assert _parse("plan", []) == Demo(5, "a", False)
    assert _parse("train", ["--demo-mode", "c"]).mode == "c"
    assert read_section(Demo, {"demo_level": 7, "demo_quick": True}, "simulate") == Demo(7, "a", True)
    assert read_section(Demo, {"demo_level": 7, "demo_quick": True}) == Demo(7, "a", False)  # train's
    assert read_section(Demo, {}, "plan") == Demo(5, "a", False)


def test_only_train_fields_reach_the_toml_table() -> None:
    assert flat_defaults(Demo) == {"demo_level": 2, "demo_mode": "a"}
    mine, rest = take_values(Demo, "demo", {"demo.level": 3, "demo.only_sim": True})
    assert mine == {"demo_level": 3, "demo_mode": "a"} and rest == {"demo.only_sim": True}
    assert flat_defaults(KfacOptions) == {
        "kfac_base": "adamw",
        "kfac_fill": "measured",
        "kfac_opportunistic": False,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"commands": ("simulate", "serve")}, "unknown command 'serve'"),
        ({"variants": {"plan": {"choices": ("x",)}}}, "variant for 'plan'"),
        ({"variants": {"train": {"type": int}}}, "variant for 'train'"),
    ],
)
def test_a_bad_declaration_is_refused_when_the_section_is_written(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        option(1, "--x", "x", **kwargs)


@given(value=st.sampled_from(CHOICES), train=st.sampled_from(TRAIN_CHOICES))
def test_vocab_parallel_is_one_field_with_a_wider_simulate_variant(value: str, train: str) -> None:
    for command, chosen in (("simulate", value), ("train", train)):
        args = _parser(command).parse_args(["--vocab-parallel", chosen])
        assert spec_from_args(args, command, check=False).features["vocab"].parallel == chosen
    assert [f.name for f in fields_for(VocabOptions, "simulate")] == ["parallel"]


def test_simulate_flags_come_from_the_sections() -> None:
    parser = argparse.ArgumentParser()
    register_simulate(parser.add_subparsers())
    sim = parser._subparsers._group_actions[0].choices["simulate"]
    titles = {g.title: [a.option_strings[0] for a in g._group_actions] for g in sim._action_groups}
    kfac = next(v for k, v in titles.items() if k and k.startswith("kfac: "))  # the feature's description
    assert kfac == ["--fill", "--kfac-profile", "--kfac-precondition", "--kfac-no-split", "--kfac-unit"]
    assert next(v for k, v in titles.items() if k and k.startswith("vocab: ")) == ["--vocab-parallel"]
    args = sim.parse_args(["--fill", "kfac", "--kfac-unit", "0.5"])
    opts = args.spec.features["kfac"]  # the hooks read the spec's feature section
    assert isinstance(opts, KfacOptions)
    assert (opts.simulate_fill, opts.unit, opts.precondition, opts.no_split) == ("kfac", 0.5, "tail", False)
    assert not any(t and t.startswith("async_weights") for t in titles)  # no simulate field: no group
    names = tuple(f"{f.name}:" for f in builtin_features())
    assert not [g.title for g in _parser("plan")._action_groups if g.title and g.title.startswith(names)]


def test_a_features_optimizer_name_lives_in_the_feature() -> None:
    from pipewright.optim import OPTIMIZERS, base_optimizer
    from pipewright.training.prepare_run import check_optimizer

    assert "kfac" not in OPTIMIZERS and base_optimizer("kfac") == "adamw" and base_optimizer("sgd") == "sgd"
    features = builtin_features()
    assert features["kfac"].optimizers == ("kfac",)
    check_optimizer("kfac", features)
    with pytest.raises(Exception, match="unknown optimizer 'lamb'; choose one of: adamw, sgd, kfac"):
        check_optimizer("lamb", features)
    with pytest.raises(Exception, match="'kfac' is provided by both kfac and mine"):
        features.with_features(Feature("mine", optimizers=("kfac",)))
