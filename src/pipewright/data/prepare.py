"""A token file made with a model's own tokenizer: ``pipewright data prepare --tokenizer DIR``.

``DIR`` is a Hugging Face model folder: its ``tokenizer.json`` (the ``tokenizers`` library's format)
encodes the text; its ``config.json`` (when present) gives the model's vocabulary V and end-of-text
token. The tokenizer's vocabulary (added tokens included) must fit the model's embedding: at most V
ids (models often pad V up; a larger tokenizer is an error). Documents (one per file, files sorted by
path) are encoded in order and joined with the end-of-text token when the config names one. The result
is a ``.bin`` token file with its JSON sidecar (:func:`pipewright.data.tokens.write_tokens`), memmapped
by training as any token file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipewright.data.corpus import list_files
from pipewright.data.data_errors import DataError
from pipewright.data.tokens import write_tokens

_BATCH = 64  # documents per encode_batch call


@dataclass(frozen=True)
class ModelTokenizer:
    """A model folder's tokenizer, its vocabulary (added tokens included), the model's vocabulary V
    (None without config.json) and the end-of-text id placed between documents (None: nothing)."""

    tokenizer: object  # tokenizers.Tokenizer
    vocab_size: int
    model_vocab: int | None
    eos_id: int | None
    folder: Path


def _config(folder: Path) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{file}: unreadable model config ({exc})") from None
    return {**data.get("text_config", {}), **data} if isinstance(data, dict) else {}


def load_model_tokenizer(folder: str | os.PathLike) -> ModelTokenizer:
    """``folder``'s tokenizer.json; a one-line DataError when it is missing or does not fit the model."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"--tokenizer {folder}: no tokenizer.json; give the model's folder")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own Exception type
        raise DataError(f"{file}: not a tokenizers file ({str(exc).splitlines()[0]})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = _config(folder)
    model_vocab = config.get("vocab_size")
    if "vocab_size" in config and (isinstance(model_vocab, bool) or not isinstance(model_vocab, int)):
        raise DataError(
            f"{folder / 'config.json'}: vocab_size must be a positive integer (got {model_vocab!r:.40})"
        )
    if isinstance(model_vocab, int) and vocab > model_vocab:
        raise DataError(
            f"--tokenizer {folder}: the tokenizer has {vocab} tokens but the model's vocabulary is "
            f"{model_vocab}; use the tokenizer the model was trained with"
        )
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    eos = eos if isinstance(eos, int) and 0 <= eos < vocab else None
    return ModelTokenizer(tok, vocab, model_vocab if isinstance(model_vocab, int) else None, eos, folder)


def text_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """The files of ``inputs`` (files, or folders walked in path order; hidden entries skipped)."""
    out: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [path / f.relpath for f in list_files(path)]
        else:
            raise DataError(f"{given}: no such file or folder")
    if not out:
        raise DataError(f"no text files in {', '.join(map(str, inputs))}")
    return out


def encode_files(mt: ModelTokenizer, files: Sequence[Path]) -> np.ndarray:
    """Token ids of ``files`` in order, each followed by the end-of-text id when there is one."""
    parts = []
    for i in range(0, len(files), _BATCH):
        docs = [f.read_bytes().decode("utf-8", errors="replace") for f in files[i : i + _BATCH]]
        for enc in mt.tokenizer.encode_batch(docs, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint32))
            if mt.eos_id is not None:
                parts.append(np.asarray([mt.eos_id], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def prepare_tokens(
    inputs: Sequence[str | os.PathLike], tokenizer: str | os.PathLike, out: str | os.PathLike
) -> tuple[Path, int, int]:
    """Encode ``inputs`` with the model folder ``tokenizer``'s tokenizer into the token file ``out``.
    Returns (path, number of tokens, vocabulary size recorded)."""
    mt = load_model_tokenizer(tokenizer)
    files = text_files(inputs)
    ids = encode_files(mt, files)
    if not len(ids):
        raise DataError(f"{', '.join(map(str, inputs))}: no text (0 tokens)")
    vocab = mt.model_vocab or mt.vocab_size
    path = write_tokens(
        out, ids, vocab, extra={"tokenizer": str(mt.folder), "source": ", ".join(map(str, inputs))}
    )
    return path, len(ids), vocab
