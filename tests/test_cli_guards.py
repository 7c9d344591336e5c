"""Bad input reproduced case by case: sizes refused before building, numbers refused up front
with the same line on the command line and in TOML, ignored flags named, unreadable files and unwritable
outputs in one line, help with defaults."""

from __future__ import annotations

import time

import pytest

from pipewright.cli import build_parser, main
from pipewright.cli._help import parsers
from pipewright.errors import ConfigError
from pipewright.runtime.setup.config import TrainConfig


def _err(capsys, argv: list[str], seconds: float = 20.0) -> str:
    t0 = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - t0 < seconds
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("pipewright: error: "), lines
    return lines[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "100000000", "--cost", "unit"], "1,200,000,000"),
        (["schedule", "show", "1f1b", "-p", "4", "-m", "100000000"], "--max-actions"),
        (["schedule", "show", "1f1b", "--stages", "100000", "-m", "1"], "100,000 ranks"),
        (["schedule", "export", "1f1b", "-p", "4", "-m", "100000000", "-o", "x.csv"], "--max-actions"),
    ],
)  # fmt: skip
def test_huge_sizes_are_refused_with_the_estimate_and_the_flag(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    line = _err(capsys, argv, seconds=5)
    assert words in line and "--max-actions" in line
    assert not (tmp_path / "x.csv").exists()


def test_max_actions_raises_the_limit(capsys) -> None:
    argv = ["schedule", "show", "1f1b", "-p", "2", "-m", "4"]
    assert main([*argv, "--max-actions", "10"]) == 2
    capsys.readouterr()
    assert main([*argv, "--max-actions", "100"]) == 0


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--lr", "inf", "--lr must be a finite number (got inf)"),
        ("--lr", "nan", "--lr must be a finite number (got nan)"),
        ("--lr", "-1", "--lr must be positive (got -1)"),
        ("--microbatch-size", "0", "--microbatch-size must be at least 1 (got 0)"),
        ("--seed", "-3", "--seed must be at least 0 (got -3)"),
    ],
)
def test_train_numbers_refused_the_same_on_the_command_line_and_in_toml(
    capsys, tmp_path, flag, value, message
) -> None:
    assert message in _err(capsys, ["train", flag, value, "--dry-run"])
    toml = tmp_path / "t.toml"
    number = {"inf": "inf", "nan": "nan"}.get(value, value)
    toml.write_text(f"{flag[2:].replace('-', '_')} = {number}\n")
    assert message in _err(capsys, ["train", "--config", str(toml), "--dry-run"])


def test_warmup_and_stop_after_beyond_steps_are_named(caplog) -> None:
    with caplog.at_level("WARNING"):
        TrainConfig(steps=10, warmup=25, stop_after=30).check()
    assert "--warmup 25 is not below --steps 10" in caplog.text
    assert "--stop-after 30 is beyond --steps 10" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        TrainConfig(steps=10).check()  # the default --warmup 20: no one's choice, no note on a short run
    assert "--warmup" not in caplog.text


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--microbatch-size", "0"], "--microbatch-size must be at least 1 (got 0)"),
        (["--microbatch-size", "-4"], "--microbatch-size must be at least 1 (got -4)"),
        (["--topology", "BROKEN.json"], "ignore --topology"),
        (["--cores", "nan"], "--cores must be a finite number"),
    ],
)
def test_simulate_refuses_clamps_and_ignored_flags(capsys, extra, words) -> None:
    argv = ["simulate", "--schedule", "1f1b", "--stages", "4", "-m", "8", "--cost", "unit", *extra]
    assert words in _err(capsys, argv)


def test_simulate_csv_schedule_disagreeing_with_flags(capsys, tmp_path) -> None:
    path = tmp_path / "s.csv"
    assert main(["schedule", "export", "1f1b", "-p", "2", "-m", "4", "-o", str(path)]) == 0
    capsys.readouterr()
    line = _err(capsys, ["simulate", "--schedule", str(path), "--stages", "4", "-m", "8", "--cost", "unit"])
    assert "--stages 4" in line and "--microbatches 8" in line and "2 ranks" in line
    assert main(["simulate", "--schedule", str(path), "--stages", "2", "-m", "4", "--cost", "unit"]) == 0


def test_non_utf8_files_and_broken_config_json(capsys, tmp_path) -> None:
    csv, toml = tmp_path / "s.csv", tmp_path / "t.toml"
    csv.write_bytes(b"0F0,\xff\xfe\n")
    toml.write_bytes(b"steps = 3 # \xe9t\xe9\n")
    assert "s.csv is not UTF-8" in _err(capsys, ["simulate", "--schedule", str(csv), "--cost", "unit"])
    assert "t.toml is not UTF-8" in _err(capsys, ["train", "--config", str(toml), "--dry-run"])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    assert "config.json is not JSON" in _err(capsys, ["train", "--init-from", str(hf), "--dry-run"])


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--cost", "unit", "--png", "F/x.png"],
        ["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4", "--cost", "unit", "--trace", "F/x.json"],
        ["schedule", "export", "1f1b", "-p", "2", "-m", "4", "-o", "F/x.csv"],
    ],
)
def test_unwritable_outputs_refused_before_work(capsys, tmp_path, argv) -> None:
    blocker = tmp_path / "F"
    blocker.write_text("a file where a folder should be")
    line = _err(capsys, [a.replace("F/", f"{blocker}/") for a in argv])
    assert str(blocker) in line


def test_train_seq_len_that_cannot_fit_is_refused_before_spawning(capsys) -> None:
    line = _err(capsys, ["train", "--seq-len", "100000"])
    assert "GiB" in line or "--recv-timeout" in line


def test_dry_run_prints_the_estimate_and_starts_nothing(capsys, tmp_path) -> None:
    assert main(["train", "--model", "gpt-tiny", "--out", str(tmp_path / "r"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "estimated memory" in out and "no worker started" in out
    assert not (tmp_path / "r").exists()


def test_every_flag_has_help_with_its_default() -> None:
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            assert action.help, (path, action.option_strings)
            switch = action.nargs == 0
            assert switch or "default" in action.help, (path, action.option_strings, action.help)
    plan = dict(parsers(build_parser()))[("plan",)]
    sizes = next(a for a in plan._actions if "--microbatch-sizes" in a.option_strings)
    assert "comma" in sizes.help


def test_help_shows_train_defaults_from_the_config(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 200)" in text and "(default: 1f1b)" in text  # --steps, --schedule


def test_config_error_is_a_pipewright_error() -> None:
    with pytest.raises(ConfigError):
        TrainConfig(lr=float("inf")).check()


def test_unwritable_out_is_refused_before_workers_start(capsys, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    line = _err(capsys, ["train", "--model", "gpt-tiny", "--out", str(blocker / "run"), "--dry-run"])
    assert "--out" in line and "is a file, not a folder" in line


def test_out_without_room_for_a_checkpoint_is_refused(capsys, tmp_path, monkeypatch) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    line = _err(capsys, ["train", "--model", "gpt-tiny", "--out", str(tmp_path / "r"), "--dry-run"])
    assert "a checkpoint needs about" in line


def test_empty_data_file_is_named(capsys, tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    line = _err(capsys, ["train", "--data", str(empty), "--dry-run"])
    assert "empty.txt: no text (0 bytes)" in line and "corpus-" not in line
