"""ProfiledCost: the profile format round trip and PipeFisher's measured tables."""

import csv
import json
from pathlib import Path

import pytest

from pipewright.cost import CostModel, ProfiledCost
from pipewright.cost.profiled import ProfileRow, read_profile_csv, write_profile_csv
from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD, Action, B, F, I, W
from pipewright.schedules.registry import build_schedule

REFERENCE = Path("/work/shared/reference/pipefisher-profiles")
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


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference data not on this machine")
def test_packaged_profiles_match_reference():
    for path in sorted(REFERENCE.glob("*.csv")):
        model, _, gpu = path.stem.partition("_time_memory_")
        with path.open() as f:
            first = next(csv.DictReader(f))
        cost = ProfiledCost.from_pipefisher(model, gpu, int(first["bs"]))
        assert cost.time("layer", B) == pytest.approx(float(first["time_b"]) / 1000)
        assert cost.time("layer", "KFAC_PREC") == pytest.approx(float(first["time_prec"]) / 1000)
