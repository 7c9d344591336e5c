"""Token files: a flat little-endian array of token ids, read memory-mapped.

Format
------
``NAME.bin``
    The token ids, back to back, as ``uint16`` (vocabularies up to 65,536) or ``uint32``, little endian,
    no header (the layout ``numpy.ndarray.tofile`` writes and nanoGPT uses).
``NAME.json`` (optional sidecar, same stem)
    ``{"format": "pipewright-tokens", "dtype": "uint16", "vocab_size": 50257}`` and any extra keys
    (ignored here). A file of any name with such a sidecar is a token file (:func:`is_token_file`).

Without a sidecar the dtype comes from the ``dtype`` argument or from the name (``NAME.u16.bin``,
``NAME.uint32.bin``; plain ``.bin`` means uint16), and the vocabulary size from the ``vocab_size``
argument or, failing that, the largest id + 1. A ``.npy`` file (1-D, unsigned integers) works too.
``write_tokens`` writes the ``.bin`` and its sidecar, each atomically (temporary file + rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from pipewright.data.data_errors import DataError

FORMAT = "pipewright-tokens"
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SUFFIX_DTYPES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}
_SCAN_CHUNK = 1 << 24  # ids per chunk when scanning for the largest id


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest token dtype that holds ids 0..vocab_size-1."""
    if not 0 < vocab_size <= 1 << 32:
        raise DataError(f"vocab_size {vocab_size} out of range 1..2**32")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sidecar_path(path: str | os.PathLike) -> Path:
    """``data.bin`` -> ``data.json``."""
    return Path(path).with_suffix(".json")


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it to ``path``: readers see
    either nothing or the whole file, even with several processes building the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; cached data is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def largest_id(tokens: np.ndarray) -> int:
    """Max over the array in chunks (a memmap is scanned without loading it whole); -1 if empty."""
    best = -1
    for i in range(0, len(tokens), _SCAN_CHUNK):
        best = max(best, int(tokens[i : i + _SCAN_CHUNK].max()))
    return best


def write_tokens(
    path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, *, extra: dict | None = None
) -> Path:
    """Write ``tokens`` (1-D ints in [0, vocab_size)) to ``path`` (.bin) with its JSON sidecar.

    The dtype is the smallest of uint16/uint32 for ``vocab_size``; ``extra`` keys go into the sidecar.
    The sidecar is written last, so its presence means the ``.bin`` is complete. Returns ``path``.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path}: tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    dtype = dtype_for_vocab(vocab_size)
    if len(tokens) and (int(tokens.min()) < 0 or largest_id(tokens) >= vocab_size):
        raise DataError(f"{path}: token ids must lie in [0, {vocab_size}); raise vocab_size")
    data = tokens.astype(TOKEN_DTYPES[dtype], copy=False)
    atomic_write_bytes(path, data.tofile)
    meta = {"format": FORMAT, "dtype": dtype, "vocab_size": int(vocab_size), **(extra or {})}
    atomic_write_bytes(sidecar_path(path), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return path


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The sidecar's contents, or None when there is none."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{side}: unreadable token sidecar ({exc}); fix or delete it") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{side}: token sidecar must be a JSON object like {{'dtype': 'uint16'}}")
    if "dtype" in meta and not isinstance(meta["dtype"], str):
        raise DataError(f'{side}: "dtype" must be a string (uint16 or uint32)')
    vocab = meta.get("vocab_size")
    if vocab is not None and (
        isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= 1 << 32
    ):
        raise DataError(f'{side}: "vocab_size" must be an integer in 1..2**32, not {vocab!r:.40}')
    return meta


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a token file whatever its name: a ``.bin``/``.npy`` file, or one whose sidecar
    says so (``{"dtype": "uint16"|"uint32", "vocab_size": N}``, as :func:`write_tokens` writes), so a
    token file is never read as text."""
    path = Path(path)
    if path.suffix in (".bin", ".npy"):
        return True
    side = sidecar_path(path)
    if side == path or not side.is_file():
        return False
    try:
        meta = json.loads(side.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("dtype") in TOKEN_DTYPES and "vocab_size" in meta


def _dtype_from_name(path: Path) -> str | None:
    for suffix in path.suffixes[:-1]:
        if suffix.lower() in _SUFFIX_DTYPES:
            return _SUFFIX_DTYPES[suffix.lower()]
    return None


def open_tokens(
    path: str | os.PathLike, *, dtype: str | None = None, vocab_size: int | None = None, check: bool = True
) -> tuple[np.ndarray, int, dict]:
    """Memory-map a token file; returns (tokens, vocab_size, sidecar dict or {}).

    ``check`` scans the ids once and raises DataError if one is >= vocab_size. Explicit ``dtype`` and
    ``vocab_size`` arguments must agree with the sidecar when both are given.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file not found: {path}")
    meta = read_sidecar(path) or {}
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:  # not an .npy file, truncated, or pickled objects
            raise DataError(f"{path}: not a readable .npy array ({str(exc).splitlines()[0][:80]})") from None
        if tokens.ndim != 1 or tokens.dtype.kind != "u":
            raise DataError(
                f"{path}: expected a 1-D unsigned integer array, got {tokens.dtype} {tokens.shape}"
            )
    else:
        name = meta.get("dtype") or dtype or _dtype_from_name(path) or "uint16"
        if dtype is not None and name != dtype:
            raise DataError(f"{path}: dtype {dtype} given but the sidecar says {name}")
        if name not in TOKEN_DTYPES:
            raise DataError(f"{path}: token dtype {name!r} not supported; use uint16 or uint32")
        itemsize = TOKEN_DTYPES[name].itemsize
        size = path.stat().st_size
        if size == 0 or size % itemsize:
            raise DataError(f"{path}: size {size} bytes is not a positive multiple of {itemsize} ({name})")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[name], mode="r")
    if len(tokens) == 0:
        raise DataError(f"{path}: no tokens")
    side_vocab = meta.get("vocab_size")
    if vocab_size is not None and side_vocab is not None and int(side_vocab) != vocab_size:
        raise DataError(f"{path}: vocab_size {vocab_size} given but the sidecar says {side_vocab}")
    vocab = vocab_size or side_vocab
    if check or vocab is None:
        top = largest_id(tokens)
        if vocab is None:
            vocab = top + 1
        elif top >= int(vocab):
            raise DataError(f"{path}: token id {top} >= vocab_size {vocab}; fix the file or its vocab_size")
    return tokens, int(vocab), meta
