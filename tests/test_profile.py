"""``pipewright profile`` and ``pipewright train --compare-sim``: the profile is a ProfiledCost with F, B,
I, W, STEP for every layer type, the right PARAMS and MESSAGE sizes and B ≈ I + W; a compare run writes
both step times and the picture; bad input is one line before any worker starts. Two spawns in all
(one profile, one 2-process training run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipewright.cli import main
from pipewright.cost.profiled import ProfiledCost, read_profile_csv
from pipewright.data.tokens import write_tokens
from pipewright.ir import STEP, B, F, I, W
from pipewright.models.gpt import Block, Embedding, Head
from pipewright.models.presets import resolve_model
from pipewright.models.wgrad import plain_linear_factory
from pipewright.runtime.profiling.compare import usable_cores

DIMS = ["--model", "gpt-tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16"]
MB = 2


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "tiny.csv"
    args = [
        "profile",
        *DIMS,
        "--microbatch-size",
        str(MB),
        "--repeats",
        "5",
        "--no-progress",
        "--contention",
        "3",
    ]
    assert main([*args, "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, dtype=np.uint8)
    write_tokens(path, text.astype(np.int64), vocab_size=256)
    return str(path)


def _train(data: str, out: Path, mb: int = MB) -> list[str]:
    return [
        "train",
        *DIMS,
        "--data",
        data,
        "--microbatch-size",
        str(mb),
        "--microbatches",
        "4",
        "--out",
        str(out),
    ]


@pytest.mark.slow
def test_profile_is_a_profiled_cost(profile):
    spec = resolve_model("gpt-tiny", layers=2, hidden=32, heads=4, seq_len=16)
    rows, meta = read_profile_csv(profile.read_text())
    assert meta["hidden"] == "32" and meta["seq_len"] == "16" and meta["layers"] == "2"
    cost = ProfiledCost.load(profile, microbatch=MB, layers=2)
    for lt in ("embedding", "layer", "output"):
        measured = {r.kind for r in rows if r.layer_type == lt}
        assert {F, B, I, W, STEP, "PARAMS"} <= measured, lt
        for kind in (F, B, I, W, STEP):
            assert cost.time(lt, kind) > 0, (lt, kind)
    # one backward's arithmetic = I + W; loosely (medians of 5 sub-millisecond timings on a shared machine)
    assert 0.1 < (cost.time("layer", I) + cost.time("layer", W)) / cost.time("layer", B) < 10
    plain = plain_linear_factory
    modules = {"embedding": Embedding(spec), "layer": Block(spec, plain), "output": Head(spec, plain)}
    for lt, module in modules.items():
        assert cost.nbytes(lt, "PARAMS") == 4 * sum(p.numel() for p in module.parameters()), lt
    assert cost.nbytes("layer", "MESSAGE") == 4 * MB * 16 * 32
    assert cost.time("layer", "MESSAGE") > 0
    assert cost.nbytes("layer", F) > 0  # activations kept for the backward
    curve = [float(x) for x in meta["contention"].split(",")]
    assert len(curve) == 3 and curve[0] == 1.0 and all(x > 0 for x in curve)


@pytest.mark.slow
def test_compare_sim_writes_both_numbers(profile, data, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*_train(data, out), "--steps", "4", "--eval-every", "0", "--no-progress"]
    assert main([*args, "--compare-sim", "--profile", str(profile)]) == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["schedule"] == "1f1b" and report["pp"] == 2
    assert report["measured"]["step_time_s"] > 0 and report["predicted"]["step_time_s"] > 0
    assert report["measured"]["steps"] == [1, 2, 3]  # the first third is warm-up
    assert report["ratio"] == pytest.approx(
        report["measured"]["step_time_s"] / report["predicted"]["step_time_s"]
    )
    assert 0 <= report["predicted"]["bubble_fraction"] < 1
    assert (out / "compare.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "measured/predicted" in printed and "bubble fraction" in printed
    if not torch.cuda.is_available():  # the profile has a contention curve: the cores are shared
        assert report["predicted"]["core_sharing"] == [float(usable_cores())]
        assert "processes sharing" in printed


@pytest.mark.slow
def test_compare_sim_profiles_before_and_after_the_run(data, tmp_path, capsys):
    """Without --profile the run is profiled in-process before and after training; the prediction uses
    the mean of the two for every row, and the report shows both profiles' own predictions and the
    drift between them."""
    out = tmp_path / "run"
    argv = [*_train(data, out), "--steps", "5", "--eval-every", "0", "--no-progress", "--compare-sim"]
    assert main(argv) == 0
    before, _ = read_profile_csv((out / "profile-before.csv").read_text())
    after, _ = read_profile_csv((out / "profile-after.csv").read_text())
    merged, meta = read_profile_csv((out / "profile.csv").read_text())
    assert meta["merged"] == "2"
    for r, a, m in zip(before, after, merged, strict=True):
        assert (r.layer_type, r.kind) == (a.layer_type, a.kind) == (m.layer_type, m.kind)
        times = [x for x in (r.seconds, a.seconds) if x > 0]
        assert m.seconds == pytest.approx(sum(times) / len(times) if times else 0.0), r
    report = json.loads((out / "compare.json").read_text())
    by = report["predicted"]["by_profile"]
    assert by["before"] > 0 and by["after"] > 0
    assert set(report["profile_drift"]) == {F, B, I, W, STEP, "MESSAGE", "contention"}
    layer = {
        r.kind: (r.seconds, a.seconds) for r, a in zip(before, after, strict=True) if r.layer_type == "layer"
    }
    assert report["profile_drift"][F] == pytest.approx(layer[F][1] / layer[F][0])
    printed = capsys.readouterr().out
    assert "profiled before and after the run" in printed


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_bad_input_is_one_line(profile, data, tmp_path, capsys):
    base = [*_train(data, tmp_path / "x"), "--steps", "2", "--compare-sim"]
    err = _error(capsys, [*base, "--profile", str(tmp_path / "missing.csv")])
    assert "missing.csv does not exist" in err and "pipewright profile" in err
    other = tmp_path / "other.csv"
    other.write_text(profile.read_text().replace("hidden=32", "hidden=64", 1))
    err = _error(capsys, [*base, "--profile", str(other)])
    assert "another model" in err and "hidden 64 (run: 32)" in err
    err = _error(capsys, [*base[:-1], "--profile", str(profile)])
    assert "add --compare-sim" in err
    err = _error(capsys, [*_train(data, tmp_path / "x", mb=3), "--compare-sim", "--profile", str(profile)])
    assert "no microbatch size 3" in err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()  # nothing trained


def test_replay_of_a_simulated_timeline_is_exact():
    """Replaying a timeline the simulator made, with its own per-action durations, reproduces it."""
    from pipewright.cost.profiled import ProfiledComm, ProfileRow
    from pipewright.runtime.profiling.compare import ReplayCost
    from pipewright.schedules import build_schedule
    from pipewright.sim.engine import simulate

    rows = [
        ProfileRow(lt, 1, kind, t)
        for lt, scale in (("embedding", 0.1), ("layer", 1.0), ("output", 0.3))
        for kind, t in ((F, scale), (I, 1.1 * scale), (W, 0.9 * scale))
    ]
    rows.append(ProfileRow("layer", 1, "MESSAGE", 0.05, 100.0))
    cost = ProfiledCost(tuple(rows), 1, 8)
    comm = ProfiledComm.from_cost(cost)
    for name in ("1f1b", "zb-h1"):
        sim = simulate(build_schedule(name, 4, 8), cost, comm=comm)
        replay = simulate(sim.schedule, ReplayCost.from_timeline(cost, sim.timeline), comm=comm)
        assert replay.iteration_time == pytest.approx(sim.iteration_time)
        assert replay.bubble_fraction == pytest.approx(sim.bubble_fraction)


def test_profile_bad_input_is_one_line(tmp_path, capsys):
    out = ["--out", str(tmp_path / "p.csv")]
    assert "--microbatch-size values must be at least 1" in _error(
        capsys, ["profile", *DIMS, "--microbatch-size", "0", *out]
    )
    assert "multiple of --tp 2" in _error(capsys, ["profile", *DIMS, "--tp", "2", "--workers", "3", *out])
    assert "not divisible by --tp 3" in _error(capsys, ["profile", *DIMS, "--tp", "3", *out])
    assert "--contention must be 0 or more" in _error(capsys, ["profile", *DIMS, "--contention", "-1", *out])
    assert not (tmp_path / "p.csv").exists()


def test_summary_warns_when_the_machine_drifted_during_the_run():
    """A bracketed run whose two profiles disagree by more than 10 % on the layer's F or B gets a
    warning line; one that stayed steady, or a run predicted from a --profile file, does not."""
    from pipewright.runtime.profiling.compare import summary

    def report(drift: dict[str, float] | None) -> dict:
        predicted = {
            "step_time_s": 0.5,
            "pipeline_time_s": 0.45,
            "optimizer_time_s": 0.05,
            "bubble_fraction": 0.1,
        }
        r = {
            "pp": 2,
            "dp": 1,
            "tp": 1,
            "ratio": 1.0,
            "measured": {"step_time_s": 0.5, "bubble_fraction": 0.1, "steps": [1, 2]},
            "predicted": predicted,
        }
        if drift is not None:
            predicted["by_profile"] = {"before": 0.5, "after": 0.5}
            r["profile_drift"] = drift
        return r

    assert "warning: the machine's speed changed" in summary(report({"F": 1.0, "B": 0.85}))
    assert "warning" not in summary(report({"F": 1.08, "B": 0.95, "MESSAGE": 2.0}))
    assert "warning" not in summary(report(None))
    assert "layer forward 1.00x, layer backward 0.85x" in summary(report({"F": 1.0, "B": 0.85}))
    assert "warning" in summary(report({"F": 1.0, "B": 1.0, "contention": 0.84}))
