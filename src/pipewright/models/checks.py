"""What a model read from someone's files (a Hugging Face ``config.json``, its weights) must satisfy
before a run starts, so a worker never fails on it with a library's message that names no file.

- :func:`check_dimensions`: layers, hidden size, heads, key/value heads, vocabulary, sequence length and
  MLP width positive integers within :data:`MAX_DIMS`; hidden divisible by heads and heads by key/value
  heads (multi-head attention splits the hidden size evenly).
- :func:`check_weights`: each safetensors file a folder holds (``model.safetensors``, or the shards a
  ``model.safetensors.index.json`` lists) has a readable header — 8 bytes of little-endian length, then
  that many bytes of JSON naming each tensor's dtype, shape and byte range, every range inside the file
  (the format's definition, https://github.com/huggingface/safetensors) — read without loading a tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.models.spec import ModelSpec

#: upper bounds well beyond any published model, below what a typo or overflow gives
MAX_DIMS = {
    "layers": 10_000,
    "hidden": 1 << 18,
    "heads": 1 << 14,
    "vocab": 1 << 32,
    "seq_len": 1 << 24,
    "ffn_hidden": 1 << 20,
    "kv_heads": 1 << 14,
}
#: a safetensors header larger than this is damage, not a header (the format caps it at 100 MB)
MAX_HEADER_BYTES = 100_000_000


def check_dimensions(spec: ModelSpec, where: str) -> ModelSpec:
    """``spec`` when its dimensions are usable (module docstring); else one line naming ``where``."""
    for name, high in MAX_DIMS.items():
        value = getattr(spec, name)
        if name == "kv_heads" and value == 0:
            continue  # 0: as many as the heads
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ConfigError(f"{where}: {name} must be an integer in 1..{high:,} (got {value!r:.40})")
    if spec.hidden % spec.heads:
        raise ConfigError(f"{where}: hidden size {spec.hidden} is not divisible by the {spec.heads} heads")
    kv = spec.kv_heads or spec.heads
    if spec.heads % kv:
        raise ConfigError(f"{where}: {spec.heads} heads are not divisible by the {kv} key/value heads")
    return spec


def _header(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"weights {path}: {size} bytes, too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ConfigError(
                f"weights {path}: not a safetensors file (a header of {n:,} bytes in a file of {size:,})"
            )
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"weights {path}: the safetensors header is not JSON (a damaged file?)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"weights {path}: the safetensors header is not a JSON object")
    body = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        ok = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)
        if not ok or not 0 <= offsets[0] <= offsets[1] <= body:
            raise ConfigError(
                f"weights {path}: tensor {name[:60]!r} lies outside the file's {body:,} data bytes "
                "(truncated?)"
            )
    return header


def check_weights(folder: str | Path) -> list[Path]:
    """The safetensors files of ``folder`` after their headers were read (module docstring); [] when it
    holds no weights."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        from pipewright.files import read_text

        try:
            data = json.loads(read_text(index, "weights index"))
        except ValueError:
            raise ConfigError(f"weights index {index} is not JSON") from None
        shards = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
            raise ConfigError(f'weights index {index}: no "weight_map" of tensor names to shard files')
        files = [folder / name for name in sorted(set(shards.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(
                f"weights index {index} lists shard(s) not in {folder}: {', '.join(missing[:3])}"
            )
    elif single.is_file():
        files = [single]
    else:
        return []
    for file in files:
        _header(file)
    return files
