"""ProfiledCost: the profile format round trip and PipeFisher's measured tables."""

import csv
import json
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipewright.cost import CostModel, ProfiledCost
from pipewright.cost.profiled import ProfileRow, mean_profile, read_profile_csv, write_profile_csv
from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD, Action, B, F, I, W
from pipewright.schedules.registry import build_schedule

ROWS = (
    ProfileRow("embedding", 2, F, 0.5, 10.0),
    ProfileRow("layer", 2, F, 1.0, 100.0),
    ProfileRow("layer", 2, B, 2.0),
    ProfileRow("output", 2, F, 0.25, 7.0),
    ProfileRow("output", 2, I, 0.5),
    ProfileRow("output", 2, W, 0.25),
    ProfileRow("layer", 2, "PARAMS", 0.0, 1000.0),
    ProfileRow("layer", 2, "MESSAGE", 0.0, 64.0),
    ProfileRow("layer", 4, F, 3.0),
)


def test_csv_round_trip_and_lookup(tmp_path):
    text = write_profile_csv(ROWS, {"model": "gpt-tiny", "device": "cpu"})
    rows, meta = read_profile_csv(text)
    assert rows == ROWS and meta == {"model": "gpt-tiny", "device": "cpu"}
    path = tmp_path / "p.csv"
    path.write_text(text)
    cost = ProfiledCost.load(path, microbatch=2, layers=4)
    assert isinstance(cost, CostModel)
    schedule = build_schedule("1f1b", 2, 2)
    t = lambda kind, stage: cost.compute_time(Action(stage, kind, 0), schedule)  # noqa: E731
    assert t(F, 0) == 0.5 + 2 * 1.0 and t(F, 1) == 2 * 1.0 + 0.25
    assert t(I, 0) == t(W, 0) == 2 * 1.0  # B/2 per layer; the embedding has no backward row
    assert t(B, 1) == 2 * 2.0 + 0.75  # output: B = I + W
    assert cost.activation_bytes(Action(0, F, 0), schedule) == 210.0
    assert cost.activation_bytes(Action(0, B, 0), schedule) == -210.0
    assert cost.message_bytes(Action(0, "SEND_F", 0), schedule) == 64.0
    assert cost.message_bytes(Action(0, REDUCE_GRAD), schedule) == 2000.0
    assert cost.static_bytes(1, schedule) == 2000.0
    json_path = tmp_path / "p.json"
    json_path.write_text(json.dumps(cost.to_json()))
    assert ProfiledCost.load(json_path, microbatch=2, layers=4).rows == ROWS


def test_errors():
    with pytest.raises(ConfigError, match="no microbatch size 3; measured: 2, 4"):
        ProfiledCost(ROWS, microbatch=3, layers=4)
    with pytest.raises(ConfigError, match="lacks column"):
        read_profile_csv("layer_type,kind,seconds\nlayer,F,1\n")
    with pytest.raises(ConfigError, match="layer_type 'mlp'"):
        read_profile_csv("layer_type,microbatch_size,kind,seconds\nmlp,1,F,1\n")
    with pytest.raises(ConfigError, match="no PipeFisher profile for 'gpt2' on 'v100'"):
        ProfiledCost.from_pipefisher("gpt2", "v100", 1)


def test_pipefisher_profiles():
    cost = ProfiledCost.from_pipefisher("bert-base", "v100", 8)
    schedule = build_schedule("1f1b", 4, 4)  # 3 blocks per stage
    assert cost.compute_time(Action(1, F, 0), schedule) == pytest.approx(3 * 1.9848585128784177e-3)
    assert cost.compute_time(Action(1, I, 0), schedule) == pytest.approx(3 * 2.83358097076416e-3 / 2)
    assert cost.time("layer", "KFAC_INV") == pytest.approx(49.124979972839355e-3)
    assert cost.time("layer", "KFAC_KRON") == pytest.approx(4.862713813781738e-3)
    assert cost.activation_bytes(Action(1, F, 0), schedule) == pytest.approx(3 * 66.515625 * 2**20)


def test_packaged_profiles_read_as_published():
    """Every shipped PipeFisher table (the authors' CSVs, copied unchanged) reads back its first row:
    the B and preconditioning times in seconds."""
    tables = sorted(resources.files("pipewright.cost").joinpath("profiles", "pipefisher").iterdir(), key=str)
    tables = [p for p in tables if p.name.endswith(".csv")]
    assert len(tables) == 18  # six models on p100, v100 and rtx3090
    for path in tables:
        model, _, gpu = path.name.removesuffix(".csv").partition("_time_memory_")
        first = next(csv.DictReader(path.read_text().splitlines()))
        cost = ProfiledCost.from_pipefisher(model, gpu, int(first["bs"]))
        assert cost.time("layer", B) == pytest.approx(float(first["time_b"]) / 1000)
        assert cost.time("layer", "KFAC_PREC") == pytest.approx(float(first["time_prec"]) / 1000)


_times = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 10.0)), min_size=len(ROWS), max_size=len(ROWS))


@given(st.lists(_times, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_mean_profile_averages_each_rows_measurements(times, rnd):
    """Per row: the mean of the profiles' positive times (0 only when no profile measured it); sizes
    from the first profile; the result does not depend on the order of the profiles or of their rows."""
    profiles = []
    for k, ts in enumerate(times):
        rows = [
            ProfileRow(r.layer_type, r.microbatch_size, r.kind, t, r.bytes)
            for r, t in zip(ROWS, ts, strict=True)
        ]
        rnd.shuffle(rows)
        profiles.append((rows, {"model": "m", "contention": f"1.0,{1.5 + k}"}))
    rows, meta = mean_profile(profiles)
    assert [(r.layer_type, r.microbatch_size, r.kind, r.bytes) for r in sorted(rows, key=_key)] == sorted(
        (r.layer_type, r.microbatch_size, r.kind, r.bytes) for r in ROWS
    )
    for r in rows:
        i = ROWS.index(next(x for x in ROWS if _key(x) == _key(r)))
        positive = [ts[i] for ts in times if ts[i] > 0]
        assert r.seconds == pytest.approx(sum(positive) / len(positive) if positive else 0.0)
    assert meta["merged"] == str(len(times)) and meta["model"] == "m"
    assert meta["contention"] == f"1.0000,{1.5 + (len(times) - 1) / 2:.4f}"  # the curves' mean
    again, _ = mean_profile(list(reversed(profiles)))
    for a, b in zip(sorted(again, key=_key), sorted(rows, key=_key), strict=True):
        assert _key(a) == _key(b) and a.bytes == b.bytes and a.seconds == pytest.approx(b.seconds)


def _key(r: ProfileRow) -> tuple[str, int, str]:
    return (r.layer_type, r.microbatch_size, r.kind)


def test_mean_profile_needs_the_same_rows():
    with pytest.raises(ConfigError, match="profile 2 does not measure the same rows"):
        mean_profile([(ROWS, {}), (ROWS[:-1], {})])
    with pytest.raises(ConfigError, match="no profiles"):
        mean_profile([])
    with pytest.raises(ConfigError, match="contention curves differ"):
        mean_profile([(ROWS, {"contention": "1,1.1"}), (ROWS, {"contention": "1,1.1,1.6"})])
    with pytest.raises(ConfigError, match="contention curves differ"):
        mean_profile([(ROWS, {"contention": "1,1.1"}), (ROWS, {})])
