"""The readers fuzzed by tests/test_fuzz_files.py: for each, its valid file(s), a corpus of
malformed ones, and the command that reads them (see that module's docstring)."""

from __future__ import annotations

import io
import json
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from _fuzz_cli import (
    COUNT_BAD,
    HUGE,
    INF,
    NAN,
    NONNEGATIVE_BAD,
    POSITIVE_BAD,
    STRING_BAD,
    bytes_corpus,
    json_corpus,
    text_cuts,
)
from pipewright.cost.profiled import SIZED_KINDS
from pipewright.data.tokens import write_tokens
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule
from test_fuzz_inputs import PLAN_JSON, TOPOLOGY

#: files per reader at least (the corpus sizes; the sum is over 1,000)
MINIMUM = 70
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--pp", "2", "--steps", "4"]
TINY += ["--eval-every", "0", "--model", "gpt"]
SIMULATE_MODEL = ["simulate", "--model", "llama3-8b", "--schedule", "1f1b", "--allow-no-fit"]

CALIBRATION = {
    "format": "pipewright-calibration/1",
    "accelerator": "h100-sxm",
    "dtype": "bf16",
    "gemm": [
        {"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "seconds": 0.0002, "tflops": 687.2},
        {"m": 8192, "n": 8192, "k": 8192, "seconds": 0.0016, "tflops": 687.2},
    ],
    "memory_bandwidth": 2.9e12,
    "links": {"intra_node": {"bandwidth": 3.6e11, "latency": 3e-6}},
}
PROFILE_ROWS = [
    {"layer_type": t, "microbatch_size": 1, "kind": k, "seconds": s, "bytes": 512}
    for t, k, s in [
        ("embedding", "F", 5e-4),
        ("embedding", "B", 5e-4),
        ("layer", "F", 1e-3),
        ("layer", "B", 2e-3),
        ("output", "F", 5e-4),
        ("output", "B", 1e-3),
    ]
]
PROFILE_META = "# model=gpt-tiny device=cpu layers=4 tp=1\n"
PROFILE_CSV = (
    PROFILE_META
    + "layer_type,microbatch_size,kind,seconds,bytes\n"
    + "".join(
        f"{r['layer_type']},{r['microbatch_size']},{r['kind']},{r['seconds']},{r['bytes']}\n"
        for r in PROFILE_ROWS
    )
)
PROFILE_JSON = {
    "format": "pipewright-profile",
    "version": 1,
    "meta": {"model": "gpt-tiny", "layers": "4"},
    "rows": PROFILE_ROWS,
}
PLAN = json.loads(PLAN_JSON)  # the fuzzed readers' shared valid documents
HF_CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
TRAIN_TOML = """\
[train]
model = "gpt"
layers = 4
hidden = 32
heads = 4
seq_len = 16
pp = 2
microbatches = 2
lr = 3e-3
steps = 4
eval_every = 0
schedule = "1f1b"
"""


def make_base(root: Path) -> Path:
    """The valid files the readers' commands share: a token file, a text, a tokenizer.json."""
    ids = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, dtype=np.uint8)
    write_tokens(root / "tokens.bin", ids.astype(np.int64), vocab_size=256)
    (root / "text.txt").write_text("the cat sat on the mat " * 20)
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[EOS]", "the", "cat", "sat", "on", "a", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    return root


def _weights(n: int = 64) -> bytes:
    """A valid safetensors file of one float32 tensor of ``n`` values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(4 * n)


def _schedule_csv() -> str:
    return to_csv(build_schedule("1f1b", 2, 4)).rstrip("\n")


def _mutated_csv(
    text: str,
    seed: int,
    tokens: tuple[str, ...],
    count: int,
    valid: Callable[[list[str], int, str], bool] | None = None,
) -> list[tuple[str, bytes]]:
    """``text`` with one cell replaced by one of ``tokens``, ``count`` times; ``valid(row, j, token)``:
    a replacement the format allows (left out: it is no malformed file)."""
    rng = random.Random(seed)
    lines = [line.split(",") for line in text.splitlines()]
    cases = []
    for _ in range(count):
        rows = [list(r) for r in lines]
        i = rng.randrange(len(rows))
        j = rng.randrange(len(rows[i]))
        token = rng.choice(tokens)
        if valid is not None and valid(rows[i], j, token):
            continue
        rows[i][j] = token
        cases.append((f"cell {i},{j}={token!r}", "\n".join(",".join(r) for r in rows).encode()))
    return cases


# -- the readers ----------------------------------------------------------------------------------------


@dataclass
class Reader:
    """``valid``: the files of a case that must pass; ``cases``: (what, files); ``argv(target)``: the
    command, given the case's first file (``folder``: the case's folder)."""

    valid: dict[str, bytes]
    cases: list[tuple[str, dict[str, bytes]]]
    argv: Callable[[str], list[str]]
    folder: bool = False


def _single(name: str, valid: bytes, cases: list[tuple[str, bytes]], argv) -> Reader:
    return Reader({name: valid}, [(what, {name: data}) for what, data in cases], argv)


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


def calibration_reader(base):
    gemm = {("gemm", 0, k): (*COUNT_BAD, HUGE, 2**40) for k in ("m", "n", "k")}
    fields = {
        **gemm,
        ("gemm", 0, "seconds"): (*POSITIVE_BAD, HUGE),
        ("gemm", 1, "tflops"): (*POSITIVE_BAD, HUGE),
        ("memory_bandwidth",): (*POSITIVE_BAD, HUGE),
        ("links", "intra_node", "bandwidth"): (*POSITIVE_BAD, HUGE),
        ("links", "intra_node", "latency"): (*NONNEGATIVE_BAD, HUGE),
        ("accelerator",): (*STRING_BAD, "a100-80gb"),
        ("format",): ("x", *STRING_BAD),
        ("gemm",): ([], {}, 5, "x", [5], None),
        ("links",): (5, "x", [], {"bogus": {}}, {"intra_node": 5}),
    }
    required = (("format",), ("accelerator",), ("dtype",), ("gemm",), ("memory_bandwidth",))
    cases = json_corpus(CALIBRATION, fields, required, seed=1)
    gpu = ["--gpu", "h100-sxm", "--tp", "8", "--global-batch-size", "8"]
    return _single(
        "cal.json", _json(CALIBRATION), cases, lambda f: [*SIMULATE_MODEL, *gpu, "--calibration", f]
    )


def _profile_argv(f):
    return ["simulate", "--profile", f, "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]


def _unsized_bytes_left_out(row: list[str], j: int, token: str) -> bool:
    """An empty bytes cell on a row of a kind that carries no size (a backward row) reads as 0: valid."""
    return j == 4 and token == "" and row[2] not in SIZED_KINDS


def profile_csv_reader(base):
    last = PROFILE_CSV.rstrip("\n").rfind("\n") + 1
    cases = text_cuts(PROFILE_CSV, 2, 40, end=last + len("output,1,B,"))  # the last row loses its time
    cases += bytes_corpus(PROFILE_CSV, 3, 15)
    bad = ("nan", "inf", "-inf", "-1", "x", "", "1e999", "0x10", "Q", "-0.5", "bogus")
    body = PROFILE_CSV[len(PROFILE_META) :]
    header, rows = body.split("\n", 1)
    cases += [
        (w, (PROFILE_META + header + "\n" + text.decode()).encode())
        for w, text in _mutated_csv(rows.rstrip("\n"), 4, bad, 40, valid=_unsized_bytes_left_out)
    ]
    cases += [
        ("no header", (PROFILE_META + rows).encode()),
        ("empty", b""),
        ("header only", body[:30].encode()),
    ]
    return _single("profile.csv", PROFILE_CSV.encode(), cases, _profile_argv)


def profile_json_reader(base):
    fields = {
        ("rows", 2, "seconds"): (*POSITIVE_BAD, HUGE),
        ("rows", 0, "microbatch_size"): COUNT_BAD,
        ("rows", 3, "kind"): ("Q", *STRING_BAD),
        ("rows", 1, "layer_type"): ("bogus", *STRING_BAD),
        ("rows",): (5, "x", {}, [5], []),
        ("meta",): (5, "x", []),
    }
    cases = json_corpus(PROFILE_JSON, fields, (("rows",),), seed=5)
    return _single("profile.json", _json(PROFILE_JSON), cases, _profile_argv)


def plan_reader(base):
    fields = {(k,): COUNT_BAD for k in ("tp", "pp", "dp", "microbatch_size", "microbatches")}
    fields |= {("model", k): COUNT_BAD for k in ("layers", "hidden", "heads", "vocab")}
    fields |= {
        ("schedule",): STRING_BAD,
        ("layout",): (5, "x", "Et*9|t*2L"),
        ("format",): ("x", 5),
        ("devices",): (5, "x", ["a"]),
        ("model",): (5, "x", []),
    }
    cases = json_corpus(PLAN, fields, (("model",), ("tp",), ("pp",), ("schedule",)), seed=6)
    return _single("plan.json", _json(PLAN), cases, lambda f: ["export-plan", f, "--to", "megatron"])


def topology_reader(base):
    fields = {
        ("links", 0, "bandwidth"): (*POSITIVE_BAD, HUGE),
        ("links", 0, "latency"): NONNEGATIVE_BAD,
        ("nodes", 0, "accelerator"): (5, "nope", []),
        ("nodes", 1, "type"): ("x", 5),
        ("nodes", 0, "name"): (5, None),
        ("links", 0, "a"): ("nope", 5),
        ("format",): ("x", 5),
        ("nodes",): ([], 5, "x"),
        ("links",): (5, "x", [5]),
    }
    cases = json_corpus(TOPOLOGY, fields, (("nodes",),), seed=7)
    sizes = ["--pp", "2", "--global-batch-size", "4"]
    return _single("topo.json", _json(TOPOLOGY), cases, lambda f: [*SIMULATE_MODEL, "--topology", f, *sizes])


def schedule_reader(base):
    text = _schedule_csv()
    bad = ("0X0", "9F0", "0F-1", "0F99999999", "F", "0F", "nan", "0F0", "0B0", "1W9", "", "é")
    whole = len(text.splitlines()[0])  # cut after the first line: a valid schedule of one rank
    cuts = [c for c in text_cuts(text, 8, 44) if len(c[1]) not in (whole, whole + 1)]
    cases = cuts + bytes_corpus(text, 9, 12) + _mutated_csv(text, 10, bad, 40) + [("empty", b"")]
    return _single("s.csv", text.encode(), cases, lambda f: ["simulate", "--schedule", f])


def toml_reader(base):
    rng = random.Random(11)
    cases = bytes_corpus(TRAIN_TOML, 12, 12)
    cuts = [i + 1 for i, c in enumerate(TRAIN_TOML) if c == "="] + [
        i + 2 for i, c in enumerate(TRAIN_TOML) if c == '"' and TRAIN_TOML[i - 2] == "="
    ]  # after "key =" and inside a quoted value: never a shorter valid file
    cases += [(f"cut at {k}", TRAIN_TOML[:k].encode()) for k in cuts]
    bad = {
        "layers": ["-1", "0", '"x"', "1.5", "nan", "inf", "1e300"],
        "hidden": ["-32", "0", '"x"', "nan"],
        "heads": ["0", "-4", "[]"],
        "pp": ["0", "-2", '"two"', "1e9"],
        "lr": ["nan", "inf", "-1", '"x"'],
        "steps": ["-1", "0", "1.5"],
        "schedule": ["5", '"nope"'],
        "seq_len": ["0", "-16", "nan"],
        "microbatches": ["0", "-1", "1e300"],
    }
    for key, values in bad.items():
        for value in values:
            lines = [
                f"{key} = {value}" if line.startswith(f"{key} =") else line
                for line in TRAIN_TOML.splitlines()
            ]
            cases.append((f"{key} = {value}", "\n".join(lines).encode()))
    for _ in range(10):
        cases.append(("unknown key", (TRAIN_TOML + f"bogus_{rng.randrange(999)} = 1\n").encode()))
    cases += [("no table", b"layers = 4\n"), ("two tables", (TRAIN_TOML + "[train]\n").encode())]
    data = ["--dry-run", "--data", str(base / "tokens.bin")]
    return _single("train.toml", TRAIN_TOML.encode(), cases, lambda f: ["train", "--config", f, *data])


def token_reader(base):
    rng = random.Random(13)
    cases = []
    for n in range(1, 40, 2):  # an odd byte count of uint16 ids
        cases.append((f"{n} bytes", {"t.bin": rng.randbytes(n)}))
    cases.append(("empty", {"t.bin": b""}))
    ok = np.arange(200, dtype="<u2").tobytes()
    for side in (
        '{"dtype": "uint8"}',
        '{"dtype": 5}',
        "[]",
        "5",
        "{",
        '{"dtype": "uint16", "vocab_size": -1}',
        '{"dtype": "uint16", "vocab_size": 0}',
        '{"dtype": "uint16", "vocab_size": "x"}',
        '{"dtype": "uint16", "vocab_size": NaN}',
        '{"dtype": "uint16", "vocab_size": 1e300}',
        '{"dtype": "uint16", "vocab_size": 1099511627776}',
        '{"dtype": "uint16", "vocab_size": 10}',
        '{"dtype": "uint16", "vocab_size": true}',
    ):
        cases.append((f"sidecar {side}", {"t.bin": ok, "t.json": side.encode()}))
        cases.append((f"sidecar {side}, named .tok", {"t.tok": ok, "t.json": side.encode()}))
    for k in range(1, 12):
        cases.append(
            (f"sidecar non-UTF-8 {k}", {"t.bin": ok, "t.json": b'{"dtype": "uint16"' + b"\xff" * k + b"}"})
        )
    for n in (1, 4, 8, 16):  # fewer tokens than --seq-len + 1
        cases.append((f"{n} tokens", {"t.bin": np.arange(n, dtype="<u2").tobytes()}))
    for n in (1, 8, 64):
        cases.append((f".npy garbage {n}", {"t.npy": rng.randbytes(n)}))
    for array in (np.zeros((4, 4), "<u2"), np.zeros(64, "<f4"), np.zeros(64, "<i8") - 1, np.zeros(0, "<u2")):
        buf = io.BytesIO()
        np.save(buf, array)
        cases.append((f".npy {array.dtype} {array.shape}", {"t.npy": buf.getvalue()}))
    for vocab in (2, 5, 100):  # ids above the sidecar's vocabulary
        cases.append(
            (
                f"ids over vocab {vocab}",
                {"t.bin": ok, "t.json": json.dumps({"dtype": "uint16", "vocab_size": vocab}).encode()},
            )
        )
    cases.append(("uint32 sidecar, odd size", {"t.bin": ok[:-2], "t.json": b'{"dtype": "uint32"}'}))
    valid = {"t.tok": ok, "t.json": b'{"dtype": "uint16", "vocab_size": 256}'}
    return Reader(valid, cases, lambda f: ["train", "--data", f, "--dry-run", *TINY])


def corpus_reader(base):
    rng = random.Random(14)
    cases = [("17 NUL bytes", {"c.txt": bytes(17)}), ("empty", {"c.txt": b""})]
    for _ in range(50):  # binary: NUL bytes somewhere in the first 8 KiB
        blob = bytearray(rng.randbytes(rng.randrange(1, 6000)))
        blob[rng.randrange(min(len(blob), 8192))] = 0
        cases.append((f"binary {len(blob)} bytes", {"c.txt": bytes(blob)}))
    for n in range(1, 17):  # fewer bytes (byte tokens) than --seq-len + 1
        cases.append((f"{n} bytes of text", {"c.txt": b"abcdefghijklmnopq"[:n]}))
    cases.append(("folder of binary files", {"dir/a.bin.txt": bytes(64), "dir/b": b"\0\1\2"}))
    cases.append(("empty folder", {"dir/.hidden": b"x"}))
    valid = {"c.txt": b"the cat sat on the mat " * 4}
    return Reader(
        valid,
        cases,
        lambda f: [
            "train",
            "--data",
            f.split("/dir/")[0] + "/dir" if "/dir/" in f else f,
            "--dry-run",
            *TINY,
        ],
    )


def hf_config_reader(base):
    dims = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    fields = {(k,): (NAN, INF, -1, -64, 0, "x", True, 1.5, HUGE) for k in dims}
    fields |= {("num_key_value_heads",): (-1, 3, "x", NAN), ("model_type",): ("nope", 5, "x" * 12000)}
    cases = json_corpus(HF_CONFIG, fields, (), seed=15, cuts=15, bad_bytes=10, garbage=5)
    return _single(
        "config.json", _json(HF_CONFIG), cases, lambda f: ["train", "--hf-model", f, *_hf_flags(base)]
    )


def _hf_flags(base) -> list[str]:
    return [
        "--dry-run",
        "--pp",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--data",
        str(base / "tokens.bin"),
    ]


def hf_weights_reader(base):
    rng = random.Random(16)
    good = _weights()
    config = json.dumps(HF_CONFIG).encode()
    cases = []
    for k in sorted(rng.sample(range(1, len(good) - 1), 60)):
        cases.append((f"weights cut at {k}", {"config.json": config, "model.safetensors": good[:k]}))
    for n in (0, 3, 8, 50):
        cases.append((f"weights garbage {n}", {"config.json": config, "model.safetensors": rng.randbytes(n)}))
    cases.append(
        (
            "header length huge",
            {"config.json": config, "model.safetensors": struct.pack("<Q", 2**60) + good[8:]},
        )
    )
    cases.append(
        ("header not JSON", {"config.json": config, "model.safetensors": struct.pack("<Q", 4) + b"\xff{{{"})
    )
    for index in (
        b"{",
        b"[]",
        b'{"weight_map": 5}',
        b'{"weight_map": {"w": "missing.safetensors"}}',
        b"\xff",
    ):
        cases.append(
            (f"index {index[:20]!r}", {"config.json": config, "model.safetensors.index.json": index})
        )
    valid = {"config.json": config, "model.safetensors": good}
    return Reader(valid, cases, lambda f: ["train", "--hf-model", f, *_hf_flags(base)], folder=True)


def tokenizer_reader(base):
    doc = json.loads((base / "tokenizer.json").read_text())
    fields = {
        ("model", "type"): ("nope", 5, None),
        ("model", "vocab"): (5, "x", None, [1]),
        ("model",): (5, "x", None, []),
        ("pre_tokenizer",): (5, "x", {"type": "nope"}),
    }
    cases = [(w, {"tokenizer.json": b}) for w, b in json_corpus(doc, fields, (("model",),), seed=17, cuts=20)]
    good = (base / "tokenizer.json").read_bytes()
    for vocab in (-1, 0, 4, "x", NAN, 1.5, None, True):  # the model's vocabulary in its config.json
        cases.append(
            (
                f"config vocab_size {vocab!r}",
                {"tokenizer.json": good, "config.json": json.dumps({"vocab_size": vocab}).encode()},
            )
        )
    cases.append(("config not JSON", {"tokenizer.json": good, "config.json": b"\xff{"}))
    argv = lambda f: ["data", "prepare", str(base / "text.txt"), "--tokenizer", f, "-o", f + "-out.bin"]  # noqa: E731
    return Reader({"tokenizer.json": good}, cases, argv, folder=True)


READERS = {
    "calibration": calibration_reader,
    "profile CSV": profile_csv_reader,
    "profile JSON": profile_json_reader,
    "plan": plan_reader,
    "topology": topology_reader,
    "schedule CSV": schedule_reader,
    "train TOML": toml_reader,
    "token file": token_reader,
    "text corpus": corpus_reader,
    "HF config": hf_config_reader,
    "HF weights": hf_weights_reader,
    "tokenizer": tokenizer_reader,
}
