"""Reading and writing user-named files with one-line errors: a file that is not UTF-8 text, an output
path that cannot be written (checked before the work that produces it starts)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipewright.errors import ConfigError


def read_text(path: str | Path, what: str = "file") -> str:
    """The file's text; a one-line :class:`ConfigError` naming the file when it is missing, a folder,
    unreadable or not UTF-8 (with the offset of the first bad byte)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder, not a file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None


def check_writable(path: str | Path | None, flag: str) -> None:
    """Refuse in one line, before any work, an output file that cannot be created or replaced: its folder
    missing or not writable, the path a folder, or the file itself read-only."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist; create it first")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: the file is not writable (permission denied)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: folder {folder} is not writable (permission denied)")


def check_writable_folder(folder: str | Path, flag: str, need_bytes: int = 0) -> None:
    """An output folder (created later if missing): its nearest existing ancestor must be a writable
    folder with ``need_bytes`` free."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag} {folder}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {folder}: {probe} is not writable (permission denied)")
    if need_bytes:
        free = shutil.disk_usage(probe).free
        if free < need_bytes:
            raise ConfigError(
                f"{flag} {folder}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
                f"{need_bytes / 2**30:.2f} GiB; free disk space or choose another --out"
            )
