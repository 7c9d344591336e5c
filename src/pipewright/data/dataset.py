"""The one dataset type the trainer uses, and ``open_dataset`` that makes it from a path (or none).

Split: the token stream's last ``val_fraction`` is the validation split, the rest the training split;
windows are drawn inside one split, so no training window overlaps a validation window.

Sampling: batch ``step`` of ``split`` draws ``batch_size`` window starts uniformly from
[0, len(split) - seq_len - 1] with ``numpy.random.Generator(PCG64(SeedSequence([seed, split_id, step])))``
(split_id 0 = train, 1 = val). A window holds seq_len + 1 tokens: inputs are its first seq_len tokens,
targets its last seq_len. The batch is a pure function of (data, seed, split, step, batch_size,
seq_len) -- no state carries between calls -- so every parallel layout sees the same global batch, and a
resumed run continues the same sequence.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipewright.data.corpus import DEFAULT_MAX_BYTES, stdlib_corpus, text_corpus
from pipewright.data.corpus import cache_dir as resolve_cache_dir
from pipewright.data.data_errors import DataError
from pipewright.data.tokenizer import Codec, parse_tokenizer_spec
from pipewright.data.tokens import is_token_file, open_tokens

SPLITS = ("train", "val")


@dataclass(frozen=True, eq=False)
class TokenDataset:
    """Training and validation token arrays (often memmaps) over a vocabulary of ``vocab_size``."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    codec: Codec | None = None
    info: dict = field(default_factory=dict)

    def _split(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; use 'train' or 'val'")
        return self.train if split == "train" else self.val

    def num_tokens(self, split: str) -> int:
        return len(self._split(split))

    def batch(
        self, split: str, step: int, batch_size: int, seq_len: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 [batch_size, seq_len], targets = inputs shifted left by one token.

        A deterministic function of (seed, split, step, batch_size, seq_len); see the module docstring.
        """
        tokens = self._split(split)
        if batch_size < 1 or seq_len < 1 or step < 0 or seed < 0:
            raise DataError(
                f"batch needs batch_size >= 1, seq_len >= 1, step >= 0, seed >= 0; got "
                f"{batch_size}, {seq_len}, {step}, {seed}"
            )
        span = len(tokens) - seq_len  # number of valid window starts
        if span < 1:
            raise DataError(
                f"the {split} split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use a shorter --seq-len, more data, or another val_fraction"
            )
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, SPLITS.index(split), step])))
        starts = rng.integers(0, span, size=batch_size)
        windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
        return windows[:, :-1], windows[:, 1:]

    def check_size(self, seq_len: int, splits: Iterable[str] = SPLITS) -> None:
        """The one-line error :meth:`batch` would raise in a worker, raised before any starts: each of
        ``splits`` needs at least ``seq_len + 1`` tokens (one window)."""
        for split in splits:
            have = self.num_tokens(split)
            if have < seq_len + 1:
                raise DataError(
                    f"{self.description}: the {split} split has {have:,} tokens, fewer than --seq-len + 1 = "
                    f"{seq_len + 1:,}; give more data or --seq-len {max(have - 1, 1)} or less"
                )

    def decode(self, ids: Iterable[int]) -> str:
        """Text for token ids; DataError for token files, whose tokenizer pipewright does not know."""
        if self.codec is None:
            raise DataError(f"{self.description}: no tokenizer known to decode these tokens")
        return self.codec.decode(ids)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last round(len * val_fraction) tokens; both are views."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = round(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]


def open_dataset(
    path: str | os.PathLike | None,
    *,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    progress: bool | None = None,
) -> TokenDataset:
    """Open the dataset at ``path``.

    - None: the default corpus (standard-library sources, capped at ``max_bytes``, 20 MB by default),
      tokenized with ``tokenizer`` ("byte" or "bpe:N") and cached.
    - a token file (``.bin`` / ``.npy``, or any name with a token sidecar): memory-mapped;
      ``vocab_size`` / ``dtype`` come from the JSON sidecar or these arguments (``tokenizer`` is ignored).
    - a directory of text files or a text file: tokenized like the default corpus and cached
      (``max_bytes`` caps it when given); a binary file (NUL bytes) is refused.

    ``progress``: None shows progress bars only on a terminal; False never.
    """
    cache = resolve_cache_dir(cache_dir)
    if path is None:
        spec = parse_tokenizer_spec(tokenizer)
        corpus = stdlib_corpus(
            spec,
            max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
            cache=cache,
            progress=progress,
        )
        return _from_tokens(
            corpus.tokens, corpus.vocab_size, corpus.info["source"], val_fraction, corpus.codec, corpus.info
        )
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path}")
    if path.is_file() and is_token_file(path):  # by name or by its sidecar: never read as text
        tokens, vocab, meta = open_tokens(path, dtype=dtype, vocab_size=vocab_size)
        info = {"source": str(path), "tokenizer": meta.get("tokenizer"), "cache_hit": None}
        return _from_tokens(tokens, vocab, f"token file {path}", val_fraction, None, info)
    spec = parse_tokenizer_spec(tokenizer)
    corpus = text_corpus(path, spec, max_bytes=max_bytes, cache=cache, progress=progress)
    return _from_tokens(
        corpus.tokens, corpus.vocab_size, f"text {path}", val_fraction, corpus.codec, corpus.info
    )


def _from_tokens(
    tokens: np.ndarray, vocab: int, description: str, val_fraction: float, codec: Codec | None, info: dict
) -> TokenDataset:
    train, val = split_tokens(tokens, val_fraction)
    return TokenDataset(train, val, vocab, description, codec, {**info, "num_tokens": len(tokens)})
