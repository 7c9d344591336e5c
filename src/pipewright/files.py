"""Reading and writing user-named files with one-line errors: a file that is not UTF-8 text, a malformed
file (every error names it: :func:`naming`), an output path that cannot be written (checked before the
work that produces it starts; the whole rule is :mod:`pipewright.outputs`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipewright.errors import ConfigError, PipewrightError
from pipewright.outputs import check_folder_writable, check_name_length, shown


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


def check_writable_folder(folder: str | Path, flag: str, need_bytes: int = 0) -> None:
    """An output folder (created later if missing): a name the file system holds, and its nearest
    existing ancestor a folder that takes a new file with ``need_bytes`` free."""
    folder = Path(folder)
    check_name_length(folder, flag)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{flag} {shown(folder)}: {shown(probe)} is a file, not a folder")
    try:
        check_folder_writable(probe, flag, folder, need_bytes)
    except ConfigError as exc:
        if need_bytes and "free" in str(exc):
            free = shutil.disk_usage(probe).free
            raise ConfigError(
                f"{flag} {shown(folder)}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
                f"{need_bytes / 2**30:.2f} GiB; free disk space or choose another --out"
            ) from None
        raise


#: what a reader's gap raises on a malformed file (turned into one line naming the file)
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)


@contextmanager
def naming(path: str | Path, what: str) -> Iterator[None]:
    """Errors raised while reading the ``what`` file ``path`` name it: a PipewrightError whose message
    lacks the file's name gets it in front; a Python error from a malformed value (a reader's gap) becomes
    one line naming the file and the first line of the error."""
    try:
        yield
    except PipewrightError as exc:
        text = str(exc)
        if str(path) in text or Path(path).name in text:
            raise
        try:
            named = type(exc)(f"{what} {shown(path)}: {text}")
        except TypeError:
            named = ConfigError(f"{what} {shown(path)}: {text}")
        raise named from None
    except _PARSE_ERRORS as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{what} {shown(path)} is malformed: {shown(first, 120)}") from None
