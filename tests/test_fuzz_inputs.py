"""Fuzzing the files people write: every input either parses or fails with a one-line PipewrightError —
never another exception (a raw traceback), never a hang (each case runs under a 10 s alarm).

Formats and what reads them (the path the CLI takes): schedule CSV (``codec.load_csv`` then
``validate``), the measured/simulated timeline JSON (``Timeline.from_json``), topology JSON
(``Topology.load``), the ``pipewright train`` TOML (``config_from_toml`` then the checks
``prepare`` runs before the data: ``check``, ``num_layers``, ``model_spec``), profile CSV and JSON
(``read_profile_csv``, ``ProfiledCost.parse_json``), token files with their JSON sidecar
(``open_tokens``). Each format gets :data:`CASES` cases from a fixed seed (``derandomize``): byte-level
mutations of a valid file (cut, insert, flip, duplicate) and structure-aware documents (the format's
keys with values of any JSON/TOML type). Valid files also round-trip, so a parser that accepts its own
output wrongly would show. Plan JSON (the planner's file) does not exist yet: pending.
"""

from __future__ import annotations

import json
import signal
import string
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipewright.codec import load_csv
from pipewright.cost.profiled import ProfiledCost, read_profile_csv, write_profile_csv
from pipewright.data.tokens import open_tokens, write_tokens
from pipewright.errors import PipewrightError
from pipewright.passes import validate
from pipewright.passes.pytorch_csv import to_csv
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import build_schedule
from pipewright.timeline import Timeline
from pipewright.topology import Topology
from pipewright.training import config_from_toml

CASES = 300
FUZZ = settings(
    max_examples=CASES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@contextmanager
def _alarm(seconds: int = 10):
    def fire(signum, frame):
        raise TimeoutError(f"input took more than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def clean(fn, *args, **kwargs):
    """Run ``fn``; a PipewrightError must have a one-line, non-empty message; anything else fails."""
    try:
        with _alarm():
            return fn(*args, **kwargs)
    except PipewrightError as exc:
        first = exc.args[0] if exc.args else ""  # ValidationError: the grid follows the first line
        assert isinstance(first, str) and first.strip() and "\n" not in first, repr(first)
        assert len(first) < 1200, first  # the TOML unknown-key message lists every key
        return None


# -- byte-level mutations of a valid file ----------------------------------------------------------------

_PIECES = st.sampled_from(
    ["", ",", "\n", '"', "#", "=", "-1", "0", "1e999", "nan", "99999999999", "F", "B", "{", "}", "[", "]",
     ":", "null", "\x00", "\ufeff", "é", "SEND_F", "REDUCE_GRAD", "true", "'", "[[train]]"]
)  # fmt: skip


@st.composite
def mutated(draw, valid: str) -> str:
    """``valid`` after 1-4 random edits: cut a slice, insert a piece or random text, flip a character,
    duplicate or drop a line."""
    text = valid
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["cut", "insert", "flip", "dup", "drop", "tail"]))
        n = len(text)
        i = draw(st.integers(0, n))
        if op == "cut":
            text = text[:i] + text[min(n, i + draw(st.integers(1, 40))) :]
        elif op == "insert":
            piece = draw(_PIECES | st.text(string.printable, max_size=12))
            text = text[:i] + piece + text[i:]
        elif op == "flip" and n:
            i = min(i, n - 1)
            text = text[:i] + draw(st.characters(codec="utf-8", exclude_categories=["Cs"])) + text[i + 1 :]
        elif op in ("dup", "drop"):
            lines = text.splitlines(keepends=True)
            if lines:
                j = draw(st.integers(0, len(lines) - 1))
                lines[j:j] = [lines[j]] if op == "dup" else []
                if op == "drop":
                    del lines[j]
                text = "".join(lines)
        elif op == "tail":
            text = text[: draw(st.integers(0, n))]  # truncated file
    return text


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _json(value) -> str:
    return json.dumps(value, allow_nan=True)


# -- schedule CSV ------------------------------------------------------------------------------------------

SCHEDULE_CSV = to_csv(build_schedule("1f1b", 2, 4)) + "\n"
SCHEDULE_LOWERED = to_csv(build_schedule("interleaved-1f1b", 2, 4, 2), with_comms=True)


def _read_schedule(path: Path, text: str) -> None:
    path.write_text(text)
    validate(load_csv(path))


@FUZZ
@given(st.one_of(mutated(SCHEDULE_CSV), mutated(SCHEDULE_LOWERED), st.text(max_size=200)))
@example("99999999F0\n")  # found by this test: walked 10^8 stages (a hang)
@example("0F0,0B0\n1F99999999,1B99999999\n")
def test_schedule_csv(tmp_path, text):
    clean(_read_schedule, tmp_path / "s.csv", text)


def test_schedule_csv_round_trips(tmp_path):
    for text in (SCHEDULE_CSV, SCHEDULE_LOWERED):
        path = tmp_path / "s.csv"
        path.write_text(text)
        assert to_csv(load_csv(path), with_comms="SEND" in text) == text.rstrip("\n") + "\n"


# -- timeline JSON -------------------------------------------------------------------------------------

TIMELINE = {
    "num_ranks": 2,
    "source": "measured",
    "meta": {"schedule": "1f1b"},
    "spans": [[0, "0F0", 0.0, 1.0, "compute", 0], [1, "1F0", 1.0, 2.0, "compute", 0]],
}


@st.composite
def timelines(draw):
    data = dict(TIMELINE)
    for key in draw(st.lists(st.sampled_from(list(TIMELINE)), max_size=2)):
        data[key] = draw(JSON_VALUES)
    if draw(st.booleans()):
        spans = [list(s) for s in TIMELINE["spans"]]
        spans[0][draw(st.integers(0, 5))] = draw(SCALARS)
        data["spans"] = spans
    return data


def _read_timeline(text: str) -> None:
    Timeline.from_json(json.loads(text))


@FUZZ
@given(st.one_of(timelines().map(_json), mutated(_json(TIMELINE)), JSON_VALUES.map(_json)))
def test_timeline_json(text):
    try:
        data = json.loads(text)
    except ValueError:
        return  # not JSON at all: the caller's json.loads error (the CLI reads via Timeline.load)
    clean(Timeline.from_json, data)


def test_timeline_round_trips():
    t = Timeline.from_json(TIMELINE)
    assert t.to_json()["spans"] == TIMELINE["spans"]


# -- topology JSON -------------------------------------------------------------------------------------

TOPOLOGY = {
    "format": "pipewright-topology",
    "version": 1,
    "name": "two",
    "nodes": [
        {"name": "h0/g0", "type": "device", "accelerator": "a100-80gb", "host": "h0"},
        {"name": "h1/g0", "type": "device", "accelerator": "a100-80gb", "host": "h1"},
        {"name": "sw", "type": "switch", "host": None},
    ],
    "links": [
        {"a": "h0/g0", "b": "sw", "kind": "ib-hdr", "bandwidth": 25e9, "latency": 2.5e-6},
        {"a": "h1/g0", "b": "sw", "kind": "ib-hdr"},
    ],
}


@st.composite
def topologies(draw):
    data = json.loads(json.dumps(TOPOLOGY))
    where = draw(st.sampled_from(["top", "node", "link"]))
    if where == "top":
        data[draw(st.sampled_from(list(TOPOLOGY)))] = draw(JSON_VALUES)
    else:
        items = data["nodes" if where == "node" else "links"]
        item = items[draw(st.integers(0, len(items) - 1))]
        keys = (
            ["name", "type", "accelerator", "host"]
            if where == "node"
            else ["a", "b", "kind", "bandwidth", "latency"]
        )
        item[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
    return data


def _load_topology(path: Path, text: str) -> None:
    path.write_text(text)
    topo = Topology.load(path)
    if len(topo.devices) >= 2:  # the parsed numbers are used: a time must come out finite and >= 0
        t = topo.collective_time("all_reduce", list(topo.devices), 1e6)
        assert t >= 0 and t == t and t != float("inf"), t


@FUZZ
@given(st.one_of(topologies().map(_json), mutated(json.dumps(TOPOLOGY, indent=1))))
def test_topology_json(tmp_path, text):
    clean(_load_topology, tmp_path / "t.json", text)


def test_topology_round_trips(tmp_path):
    path = tmp_path / "t.json"
    Topology.from_json(TOPOLOGY).save(path)
    assert Topology.load(path) == Topology.from_json(TOPOLOGY)


# -- training TOML -------------------------------------------------------------------------------------

CONFIG_TOML = """\
[train]
model = "gpt"
layers = 4
hidden = 32
heads = 4
pp = 2
dp = 1
microbatches = 4
lr = 3e-3
schedule = "1f1b"
sequence_parallel = false
keep-checkpoints = 2
on_nonfinite = "skip"
"""
FIELDS = [f for f in TrainConfig.__dataclass_fields__]
TOML_VALUES = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda x: x),
    st.booleans(),
    st.text(string.ascii_letters + string.digits + "-_ ", max_size=10),
    st.lists(st.integers(0, 9), max_size=3),
)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
        )
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v) if isinstance(v, list) else str(v)


@st.composite
def configs(draw):
    lines = ["[train]"]
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        lines.append(f"{name} = {_toml_value(draw(TOML_VALUES))}")
    return "\n".join(lines) + "\n"


def _read_config(path: Path, text: str) -> None:
    path.write_text(text)
    config = config_from_toml(path)
    config.check()  # what prepare() checks before it opens the data
    config.num_layers()
    config.model_spec(256)


@FUZZ
@given(st.one_of(configs(), mutated(CONFIG_TOML)))
def test_train_toml(tmp_path, text):
    clean(_read_config, tmp_path / "train.toml", text)


# -- profile CSV / JSON --------------------------------------------------------------------------------

PROFILE_CSV = """\
# model=gpt-tiny device=cpu
layer_type,microbatch_size,kind,seconds,bytes
layer,1,F,0.001,1024
layer,1,B,0.002,1024
embedding,1,F,0.0005,512
"""


@FUZZ
@given(st.one_of(mutated(PROFILE_CSV), st.text(max_size=200)))
def test_profile_csv(text):
    clean(read_profile_csv, text)


PROFILE_JSON = json.dumps(
    {"format": "pipewright-profile", "version": 1, "meta": {"model": "gpt-tiny"},
     "rows": [{"layer_type": "layer", "microbatch_size": 1, "kind": "F", "seconds": 0.001, "bytes": 1024}]}
)  # fmt: skip


@st.composite
def profile_documents(draw):
    data = json.loads(PROFILE_JSON)
    if draw(st.booleans()):
        data["rows"][0][draw(st.sampled_from(list(data["rows"][0])))] = draw(JSON_VALUES)
    else:
        data[draw(st.sampled_from(["rows", "version"]))] = draw(JSON_VALUES)
    return _json(data)


@FUZZ
@given(st.one_of(mutated(PROFILE_JSON), profile_documents(), JSON_VALUES.map(_json)))
def test_profile_json(text):
    clean(ProfiledCost.parse_json, text)


# Found by fuzzing, in cost/profiled.py; each is refused in one line: a "meta" that is not an object
# (else an AttributeError); NaN, infinite or negative times and sizes, and a microbatch size below 1
# (else they would silently skew every prediction).
PROFILE_GAPS = [
    '{"format": "pipewright-profile", "rows": [], "meta": 5}',
    '{"format": "pipewright-profile", "rows": [{"layer_type": "layer", "microbatch_size": 1, "kind": "F",'
    ' "seconds": "nan"}]}',
    "layer_type,microbatch_size,kind,seconds,bytes\nlayer,1,F,-1,0\n",
    "layer_type,microbatch_size,kind,seconds,bytes\nlayer,0,F,1,0\n",
]


@pytest.mark.parametrize("text", PROFILE_GAPS)
def test_profile_gaps_found_by_fuzzing(text):
    parse = ProfiledCost.parse_json if text.startswith("{") else read_profile_csv
    with pytest.raises(PipewrightError) as info:
        parse(text)
    assert "\n" not in str(info.value)


def test_profile_csv_round_trips():
    rows, meta = read_profile_csv(PROFILE_CSV)
    assert read_profile_csv(write_profile_csv(rows, meta)) == (rows, meta)


# -- token files ---------------------------------------------------------------------------------------

SIDECAR_KEYS = ["dtype", "vocab_size"]


@st.composite
def token_files(draw):
    body = draw(st.binary(max_size=64))
    sidecar = None
    if draw(st.booleans()):
        sidecar = {"dtype": "uint16", "vocab_size": 256}
        sidecar[draw(st.sampled_from(SIDECAR_KEYS))] = draw(JSON_VALUES)
        sidecar = _json(sidecar)
    elif draw(st.booleans()):
        sidecar = draw(mutated('{"dtype": "uint16", "vocab_size": 256}'))
    suffix = draw(st.sampled_from([".bin", ".u32.bin", ".npy"]))
    return body, sidecar, suffix


def _read_tokens(folder: Path, body: bytes, sidecar: str | None, suffix: str) -> None:
    for old in folder.iterdir():
        old.unlink()
    path = folder / f"tokens{suffix}"
    path.write_bytes(body)
    if sidecar is not None:
        path.with_suffix(".json").write_text(sidecar)
    tokens, vocab, _ = open_tokens(path)
    assert len(tokens) > 0 and vocab > int(np.max(tokens))


@FUZZ
@given(token_files())
def test_token_files(tmp_path, case):
    clean(_read_tokens, tmp_path, *case)


def test_token_file_round_trips(tmp_path):
    ids = np.arange(300) % 257
    write_tokens(tmp_path / "t.bin", ids, vocab_size=257)
    tokens, vocab, _ = open_tokens(tmp_path / "t.bin")
    assert vocab == 257 and np.array_equal(tokens, ids)


PLAN_JSON = json.dumps(
    {
        "format": "pipewright-plan",
        "version": 1,
        "model": {"name": "gpt-tiny", "layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256,
                  "vocab": 257, "seq_len": 64},
        "topology": "1x2-cpu",
        "devices": ["node0/gpu0", "node0/gpu1"],
        "tp": 1, "pp": 2, "dp": 1, "virtual": 1, "schedule": "1f1b",
        "microbatch_size": 1, "microbatches": 4, "global_batch_size": 4,
        "recompute": "none", "sequence_parallel": False, "dtype": "fp32",
        "layout": "Et*2|t*2L",
    }
)  # fmt: skip


def _read_plan(path: Path, text: str) -> None:
    from pipewright.plan.planfile import load

    path.write_text(text)
    plan = load(path)
    plan.chunk_layers()


@FUZZ
@given(st.one_of(mutated(PLAN_JSON), JSON_VALUES.map(_json), st.text(max_size=200)))
def test_plan_json(tmp_path, text):
    clean(_read_plan, tmp_path / "plan.json", text)


def test_plan_json_round_trips(tmp_path):
    from pipewright.plan.planfile import load

    (tmp_path / "plan.json").write_text(PLAN_JSON)
    assert load(tmp_path / "plan.json").chunk_layers() == (2, 2)
