"""Text corpora turned into cached token files.

The default corpus needs no download: the ``*.py`` files of this Python's standard library
(``sysconfig.get_paths()["stdlib"]``), sorted by relative path, without test folders and
site-packages, capped at ``DEFAULT_MAX_BYTES`` (the last file is cut to hit the cap exactly). A user
directory of text files (or one ``.txt`` file) goes through the same path.

Tokens are cached as a token file (see ``tokens.py``) in ``cache_dir()`` under a name keyed by a hash
of (format version, root, relative paths + sizes + mtimes, byte cap, tokenizer spec); a BPE
tokenizer is stored next to it as ``<key>.tokenizer.json``. Every file is written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipewright.data.data_errors import DataError
from pipewright.data.tokenizer import Codec, TokenizerSpec, fit_codec, load_codec
from pipewright.data.tokens import atomic_write_bytes, open_tokens, sidecar_path, write_tokens

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
CACHE_FORMAT = 1
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_BINARY_PROBE = 8192  # bytes looked at to decide that a file is binary (contains NUL)


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class CorpusTokens:
    """A tokenized corpus: ids (memmap), vocabulary size, codec (for decoding) and where it came from."""

    tokens: np.ndarray
    vocab_size: int
    codec: Codec
    info: dict


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$PIPEWRIGHT_CACHE``, else ``~/.cache/pipewright``."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("PIPEWRIGHT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pipewright"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(
    root: Path, pattern: str = "*", skip_dirs: frozenset[str] = frozenset({"__pycache__"})
) -> list[CorpusFile]:
    """Regular files under ``root`` matching ``pattern``, sorted by relative path; hidden entries and
    folders named in ``skip_dirs`` are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for name in filenames:
            full = Path(dirpath, name)
            if name.startswith(".") or not full.match(pattern) or not full.is_file():
                continue
            st = full.stat()
            found.append(CorpusFile(full.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return sorted(found, key=lambda f: f.relpath)


def _cap(files: list[CorpusFile], max_bytes: int | None) -> list[CorpusFile]:
    """The leading files whose sizes sum to at most ``max_bytes``; the last one is shortened to fit."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        take = min(f.size, max_bytes - total)
        kept.append(CorpusFile(f.relpath, take, f.mtime_ns) if take < f.size else f)
        total += take
    return kept


def _cache_key(root: Path, files: Sequence[CorpusFile], max_bytes: int | None, spec: TokenizerSpec) -> str:
    desc = {
        "format": CACHE_FORMAT,
        "root": str(root.resolve()),
        "files": [[f.relpath, f.size, f.mtime_ns] for f in files],
        "max_bytes": max_bytes,
        "tokenizer": str(spec),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:20]


def _read_all(root: Path, files: Sequence[CorpusFile], progress: bool | None) -> list[bytes]:
    """The files' bytes (each cut to its listed size), with a byte-counting progress bar."""
    blobs = []
    with tqdm(
        total=sum(f.size for f in files),
        desc="reading corpus",
        unit="B",
        unit_scale=True,
        disable=None if progress else True,
    ) as bar:
        for f in files:
            with open(root / f.relpath, "rb") as fh:
                blobs.append(fh.read(f.size))
            bar.update(f.size)
    return blobs


def _text_files(root: Path, files: list[CorpusFile]) -> list[CorpusFile]:
    """Drops files whose first bytes contain a NUL (binary files)."""
    kept = []
    for f in files:
        with open(root / f.relpath, "rb") as fh:
            if b"\0" not in fh.read(_BINARY_PROBE):
                kept.append(f)
    return kept


def tokenize_corpus(
    root: Path,
    files: list[CorpusFile],
    spec: TokenizerSpec,
    *,
    max_bytes: int | None,
    cache: Path,
    description: str,
    progress: bool | None = None,
) -> CorpusTokens:
    """Tokens of ``files`` (under ``root``), from the cache or built and cached now."""
    files = _cap(files, max_bytes)
    if not files:
        raise DataError(f"no text files in {root}")
    key = _cache_key(root, files, max_bytes, spec)
    bin_path = cache / f"corpus-{key}.bin"
    tok_path = cache / f"corpus-{key}.tokenizer.json"
    info = {"source": description, "tokenizer": str(spec), "cache": str(bin_path), "num_files": len(files)}
    if sidecar_path(bin_path).is_file():
        tokens, vocab, meta = open_tokens(bin_path, check=False)
        codec = load_codec(spec, tok_path.read_text() if tok_path.is_file() else None)
        log.info("using cached tokens %s (%d tokens)", bin_path, len(tokens))
        return CorpusTokens(
            tokens, vocab, codec, {**info, "num_bytes": meta.get("num_bytes"), "cache_hit": True}
        )

    log.info("tokenizing %s (%d files) with %s into %s", description, len(files), spec, bin_path)
    blobs = _read_all(root, files, progress)
    if not any(blobs):  # else the error would name the cache file built from nothing
        raise DataError(f"{description}: no text (0 bytes); give a file or folder with training text")
    codec = fit_codec(spec, blobs, progress)
    ids = codec.encode(blobs, progress)
    num_bytes = sum(len(b) for b in blobs)
    saved = codec.to_json()
    if saved is not None:
        atomic_write_bytes(tok_path, lambda f: f.write(saved.encode()))
    write_tokens(
        bin_path,
        ids,
        spec.vocab_size,
        extra={
            "source": description,
            "num_bytes": num_bytes,
            "tokenizer": str(spec),
            "num_files": len(files),
        },
    )
    tokens, vocab, _ = open_tokens(bin_path, check=False)
    return CorpusTokens(tokens, vocab, codec, {**info, "num_bytes": num_bytes, "cache_hit": False})


@functools.cache
def _stdlib_files(root: Path) -> list[CorpusFile]:
    """The standard library's sources, listed once per process (walking ~900 files takes 0.3 s; the
    installed library does not change while a process runs)."""
    return list_files(root, "*.py", STDLIB_SKIP_DIRS)


def stdlib_corpus(
    spec: TokenizerSpec,
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    cache: Path,
    progress: bool | None = None,
) -> CorpusTokens:
    """The default corpus: this Python's standard library sources (see the module docstring)."""
    root = stdlib_root()
    return tokenize_corpus(
        root,
        _stdlib_files(root),
        spec,
        max_bytes=max_bytes,
        cache=cache,
        description=f"Python standard library ({root})",
        progress=progress,
    )


def text_corpus(
    path: Path,
    spec: TokenizerSpec,
    *,
    max_bytes: int | None = None,
    cache: Path,
    progress: bool | None = None,
) -> CorpusTokens:
    """A directory of text files (all non-hidden, non-binary files, recursively) or one text file."""
    if path.is_dir():
        root, files = path, _text_files(path, list_files(path))
    else:
        st = path.stat()
        root, files = path.parent, [CorpusFile(path.name, st.st_size, st.st_mtime_ns)]
        if not _text_files(root, files):
            raise DataError(
                f"{path} is binary (it holds NUL bytes), not a text corpus; a token file needs its JSON "
                "sidecar (as `pipewright data prepare` writes) or a .bin/.npy name"
            )
    return tokenize_corpus(
        root, files, spec, max_bytes=max_bytes, cache=cache, description=str(path), progress=progress
    )
