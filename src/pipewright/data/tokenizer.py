"""Tokenizers for text corpora: ``byte`` (one token per UTF-8 byte, vocabulary 256) and ``bpe:N``
(byte-level BPE with a vocabulary of N, trained locally with the ``tokenizers`` library).

A tokenizer is chosen by a spec string; each kind is a codec class registered in ``_CODECS`` with
``fit(spec, blobs)`` (train if needed), ``from_json(spec, text)`` (reload), ``to_json()``,
``encode(blobs)`` and ``decode(ids)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
from tqdm import tqdm

from pipewright.data.data_errors import DataError

BYTE_VOCAB = 256
MAX_BPE_VOCAB = 1 << 20
_SPEC_RE = re.compile(r"(?P<kind>[a-z]+)(?::(?P<size>[0-9]+))?")


@dataclass(frozen=True)
class TokenizerSpec:
    """``kind`` ("byte" or "bpe") and the vocabulary size; ``str()`` gives the spec string back."""

    kind: str
    vocab_size: int

    def __str__(self) -> str:
        return self.kind if self.kind == "byte" else f"{self.kind}:{self.vocab_size}"


def parse_tokenizer_spec(text: str) -> TokenizerSpec:
    """Read "byte" or "bpe:N" (257 <= N <= 2**20); anything else raises DataError."""
    match = _SPEC_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    kind = match["kind"] if match else None
    if kind == "byte" and match["size"] is None:
        return TokenizerSpec("byte", BYTE_VOCAB)
    if kind == "bpe" and match["size"] is not None:
        size = int(match["size"])
        if BYTE_VOCAB < size <= MAX_BPE_VOCAB:
            return TokenizerSpec("bpe", size)
        raise DataError(
            f"tokenizer {text!r}: BPE vocabulary must be between {BYTE_VOCAB + 1} and {MAX_BPE_VOCAB}"
        )
    raise DataError(f"unknown tokenizer {text!r}; use 'byte' or 'bpe:N' (e.g. bpe:4096)")


class Codec(Protocol):
    vocab_size: int

    def encode(self, blobs: Sequence[bytes], progress: bool | None = None) -> np.ndarray: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def to_json(self) -> str | None: ...


class ByteCodec:
    """Token id = byte value. Encoding is one ``np.frombuffer`` over the concatenated files."""

    vocab_size: ClassVar[int] = BYTE_VOCAB

    @classmethod
    def fit(cls, spec: TokenizerSpec, blobs: Sequence[bytes], progress: bool | None = None) -> ByteCodec:
        return cls()

    @classmethod
    def from_json(cls, spec: TokenizerSpec, text: str | None) -> ByteCodec:
        return cls()

    def encode(self, blobs: Sequence[bytes], progress: bool | None = None) -> np.ndarray:
        return np.frombuffer(b"".join(blobs), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str | None:
        return None


class BpeCodec:
    """Byte-level BPE (GPT-2 style pre-tokenization, all 256 bytes in the initial alphabet, no special
    tokens). Training sees the files in the given order and is deterministic (the ``tokenizers``
    trainer breaks count ties by pair id, and the alphabet is sorted)."""

    _ENCODE_CHUNK = 64  # files per encode_batch call (one progress-bar tick)

    def __init__(self, tokenizer, vocab_size: int) -> None:  # tokenizer: tokenizers.Tokenizer
        self._tok = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def fit(cls, spec: TokenizerSpec, blobs: Sequence[bytes], progress: bool | None = None) -> BpeCodec:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        texts = (b.decode("utf-8", errors="replace") for b in blobs)
        tok.train_from_iterator(texts, trainer, length=len(blobs))
        return cls(tok, spec.vocab_size)

    @classmethod
    def from_json(cls, spec: TokenizerSpec, text: str | None) -> BpeCodec:
        from tokenizers import Tokenizer

        if text is None:
            raise DataError(f"tokenizer {spec}: the cached tokenizer file is missing; delete the cache")
        return cls(Tokenizer.from_str(text), spec.vocab_size)

    @property
    def trained_vocab_size(self) -> int:
        """Tokens actually learned; below ``vocab_size`` when the corpus is too small for more merges."""
        return self._tok.get_vocab_size()

    def encode(self, blobs: Sequence[bytes], progress: bool | None = None) -> np.ndarray:
        parts = []
        bar = tqdm(total=len(blobs), desc="bpe encode", unit="file", disable=None if progress else True)
        for i in range(0, len(blobs), self._ENCODE_CHUNK):
            chunk = [b.decode("utf-8", errors="replace") for b in blobs[i : i + self._ENCODE_CHUNK]]
            parts.extend(np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(chunk))
            bar.update(len(chunk))
        bar.close()
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_json(self) -> str | None:
        return self._tok.to_str()


_CODECS: dict[str, type] = {"byte": ByteCodec, "bpe": BpeCodec}


def fit_codec(spec: TokenizerSpec, blobs: Sequence[bytes], progress: bool | None = None) -> Codec:
    """Train (BPE) or create (byte) the codec for ``spec`` on the corpus ``blobs``."""
    return _CODECS[spec.kind].fit(spec, blobs, progress)


def load_codec(spec: TokenizerSpec, json_text: str | None) -> Codec:
    """Rebuild a codec from what ``to_json()`` saved."""
    return _CODECS[spec.kind].from_json(spec, json_text)
