"""The data layer: deterministic batches, disjoint splits, token files, corpus cache, tokenizers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipewright.data import (
    DataError,
    TokenDataset,
    open_dataset,
    open_tokens,
    parse_tokenizer_spec,
    write_tokens,
)
from pipewright.data.corpus import STDLIB_SKIP_DIRS, list_files, stdlib_root
from pipewright.data.dataset import split_tokens
from pipewright.errors import PipewrightError
from pipewright.viz.loss import plot_loss


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEWRIGHT_CACHE", str(tmp_path / "cache"))


def _dataset(n: int = 10_000, vocab: int = 1000, val_fraction: float = 0.1) -> TokenDataset:
    tokens = np.arange(n, dtype=np.int64) % vocab
    train, val = split_tokens(tokens, val_fraction)
    return TokenDataset(train, val, vocab, "arange")


def _write_text_corpus(root, files: int = 6) -> None:
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "lambda",
        "import",
        "return",
        "yield",
        "class",
        "def",
    ]
    rng = np.random.default_rng(0)
    for i in range(files):
        lines = [" ".join(rng.choice(words, size=8)) for _ in range(60)]
        (root / f"f{i}.txt").write_text("\n".join(lines) + "\n")


def test_batch_is_a_deterministic_function_of_seed_and_step() -> None:
    ds = _dataset()
    x1, y1 = ds.batch("train", 7, 8, 32, seed=3)
    x2, y2 = _dataset().batch("train", 7, 8, 32, seed=3)
    assert x1.dtype == y1.dtype == np.int64 and x1.shape == y1.shape == (8, 32)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, ds.batch("train", 8, 8, 32, seed=3)[0])
    assert not np.array_equal(x1, ds.batch("train", 7, 8, 32, seed=4)[0])
    # calling other batches in between changes nothing (no hidden state)
    ds.batch("val", 0, 4, 16, seed=3)
    assert np.array_equal(x1, ds.batch("train", 7, 8, 32, seed=3)[0])


def test_targets_are_inputs_shifted_by_one_token() -> None:
    ds = _dataset()
    x, y = ds.batch("train", 0, 16, 20, seed=0)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    # the source tokens are consecutive ids mod vocab, so each target is its input + 1
    assert np.array_equal((x + 1) % 1000, y)


def test_val_and_train_windows_are_disjoint() -> None:
    n, seq = 5000, 16
    tokens = np.arange(n, dtype=np.int64)  # each id marks its position in the stream
    train, val = split_tokens(tokens, 0.2)
    ds = TokenDataset(train, val, n, "positions")
    assert ds.num_tokens("train") == 4000 and ds.num_tokens("val") == 1000
    seen_train = np.unique(
        np.concatenate([np.concatenate(ds.batch("train", s, 32, seq, 0)) for s in range(20)])
    )
    seen_val = np.unique(np.concatenate([np.concatenate(ds.batch("val", s, 32, seq, 0)) for s in range(20)]))
    assert seen_train.max() < 4000 <= seen_val.min()


def test_split_too_short_and_bad_split_are_clear_errors() -> None:
    ds = _dataset(n=100, val_fraction=0.05)
    with pytest.raises(DataError, match="val split has 5 tokens"):
        ds.batch("val", 0, 1, 8, 0)
    with pytest.raises(DataError, match="unknown split"):
        ds.batch("test", 0, 1, 8, 0)


@pytest.mark.parametrize(("vocab", "dtype"), [(300, "uint16"), (70_000, "uint32")])
def test_token_file_round_trip(tmp_path, vocab: int, dtype: str) -> None:
    ids = np.random.default_rng(1).integers(0, vocab, size=4096)
    path = write_tokens(tmp_path / "toks.bin", ids, vocab)
    assert json.loads((tmp_path / "toks.json").read_text()) == {
        "format": "pipewright-tokens",
        "dtype": dtype,
        "vocab_size": vocab,
    }
    tokens, got_vocab, _ = open_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    assert got_vocab == vocab and np.array_equal(tokens, ids)
    ds = open_dataset(path, val_fraction=0.25)
    assert ds.vocab_size == vocab and ds.num_tokens("train") == 3072 and ds.num_tokens("val") == 1024
    assert np.array_equal(ds.val, ids[3072:])


def test_token_file_without_sidecar_uses_name_or_argument(tmp_path) -> None:
    ids = np.array([5, 70_000, 3], dtype=np.uint32)
    ids.tofile(tmp_path / "x.u32.bin")
    tokens, vocab, _ = open_tokens(tmp_path / "x.u32.bin")
    assert np.array_equal(tokens, ids) and vocab == 70_001  # largest id + 1
    np.save(tmp_path / "y.npy", ids)
    assert open_dataset(tmp_path / "y.npy", vocab_size=80_000, val_fraction=0).vocab_size == 80_000


def test_missing_file_is_a_one_line_error_naming_the_path(tmp_path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(PipewrightError) as err:
        open_dataset(missing)
    assert isinstance(err.value, DataError) and str(missing) in str(err.value) and "\n" not in str(err.value)


def test_token_ids_beyond_vocab_are_rejected(tmp_path) -> None:
    with pytest.raises(DataError, match=r"\[0, 10\)"):
        write_tokens(tmp_path / "a.bin", np.array([1, 10]), vocab_size=10)
    write_tokens(tmp_path / "b.bin", np.array([1, 9, 12]), vocab_size=16)
    (tmp_path / "b.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 10}))
    with pytest.raises(DataError, match="token id 12 >= vocab_size 10"):
        open_dataset(tmp_path / "b.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="multiple of 2"):
        open_tokens(tmp_path / "odd.bin")


def test_default_corpus_is_cached_and_reused(tmp_path) -> None:
    first = open_dataset(None, max_bytes=50_000, progress=False)
    assert first.vocab_size == 256 and first.info["cache_hit"] is False
    assert first.info["num_tokens"] == 50_000  # byte level: one token per byte, cap hit exactly
    assert "Python standard library" in first.description
    cached = first.info["cache"]
    mtime = os.stat(cached).st_mtime_ns
    again = open_dataset(None, max_bytes=50_000, progress=False)
    assert again.info["cache_hit"] is True and again.info["cache"] == cached
    assert os.stat(cached).st_mtime_ns == mtime
    assert np.array_equal(first.train, again.train)
    assert np.array_equal(first.batch("train", 3, 4, 64, 0)[0], again.batch("train", 3, 4, 64, 0)[0])
    # byte tokens are the first standard-library file's bytes
    head = (stdlib_root() / list_files(stdlib_root(), "*.py", STDLIB_SKIP_DIRS)[0].relpath).read_bytes()
    assert bytes(first.train[:200].astype(np.uint8)) == head[:200]
    other = open_dataset(None, max_bytes=40_000, progress=False)
    assert other.info["cache_hit"] is False and other.info["cache"] != cached
    assert np.array_equal(other.train[:1000], first.train[:1000])  # same files in the same order


def test_bpe_tokenizer_trains_deterministically_with_requested_vocab(tmp_path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_text_corpus(corpus)
    (corpus / "blob.dat").write_bytes(b"\x00\x01binary")  # skipped: not text
    ds = open_dataset(corpus, tokenizer="bpe:300", val_fraction=0.1, progress=False)
    assert ds.vocab_size == 300 and ds.codec.trained_vocab_size == 300
    assert ds.info["tokenizer"] == "bpe:300" and ds.info["num_files"] == 6 and ds.train.dtype == np.uint16
    assert int(max(ds.train.max(), ds.val.max())) < 300
    text = (corpus / "f0.txt").read_text()
    assert ds.decode(np.concatenate([ds.train, ds.val])).startswith(text[:200])
    # retrained from scratch in another cache: the same tokens
    fresh = open_dataset(corpus, tokenizer="bpe:300", val_fraction=0.1, cache_dir=tmp_path / "other")
    assert fresh.info["cache_hit"] is False and np.array_equal(fresh.train, ds.train)
    assert open_dataset(corpus, tokenizer="bpe:300", progress=False).info["cache_hit"] is True


def test_text_file_byte_level(tmp_path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("héllo world\n" * 50)
    ds = open_dataset(path, val_fraction=0)
    assert ds.num_tokens("train") == len(path.read_bytes()) and ds.num_tokens("val") == 0
    assert ds.decode(ds.train[:12]) == "héllo world"


@given(st.integers(257, 1 << 20))
def test_tokenizer_spec_round_trip(size: int) -> None:
    spec = parse_tokenizer_spec(f"bpe:{size}")
    assert (spec.kind, spec.vocab_size, str(spec)) == ("bpe", size, f"bpe:{size}")
    assert parse_tokenizer_spec(str(spec)) == spec


@given(st.text(max_size=12))
def test_tokenizer_spec_garbage_is_a_data_error(text: str) -> None:
    spec = text.strip()
    size = spec[4:]
    if spec == "byte" or (
        spec[:4] == "bpe:" and size.isascii() and size.isdigit() and 256 < int(size) <= 1 << 20
    ):
        return  # a valid spec
    with pytest.raises(DataError):
        parse_tokenizer_spec(text)


def test_tokenizer_spec_edges() -> None:
    assert parse_tokenizer_spec("byte").vocab_size == 256
    for bad in ["bpe", "bpe:", "bpe:256", "bpe:-5", "byte:4", "BPE:4096", "bpe:4096x", "wordpiece:100"]:
        with pytest.raises(DataError):
            parse_tokenizer_spec(bad)


def test_plot_loss_writes_png_and_rejects_empty(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": 5.0 / (s + 1), "step_time_s": 0.1} for s in range(60)]
    lines[10]["val_loss"] = 0.6
    metrics.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    png = plot_loss(metrics, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        plot_loss(tmp_path / "empty.jsonl", tmp_path / "x.png")
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(DataError, match=":2:"):
        plot_loss(tmp_path / "bad.jsonl", tmp_path / "x.png")
