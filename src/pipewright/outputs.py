"""The one rule for every file a command writes, checked before the work that produces it starts.

:func:`check_output` refuses, in one line naming the flag:

- a name the file system cannot hold: a path component over ``NAME_MAX`` bytes (255 on Linux) or a
  path over ``PATH_MAX`` (4,096);
- a folder where a file is wanted, a missing parent folder, a parent that is a file;
- a folder the process cannot create a file in (probed by creating and removing an empty file, since
  ``os.access`` says yes to root even under ``/proc`` or on a read-only mount), or an existing file it
  cannot open for writing;
- too little free space (``need_bytes``, at least :data:`MIN_FREE_BYTES`);
- an existing file, the very file a command reads, or a path inside a folder it reads (where the next
  run would read it as input) — these three unless ``--overwrite`` is given.

Every writer (``data prepare``, ``export-plan``, ``plan -o``, ``simulate --png/--trace``, ``schedule
export``, ``profile --out/--calibration``) calls it with its inputs; ``train --out`` (a folder) has its
own rule in :mod:`pipewright.runtime.checkpointing.run_folder` and shares :func:`check_name_length` and
:func:`check_folder_writable`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from pipewright.errors import ConfigError

NAME_MAX = 255
PATH_MAX = 4096
#: free space any output needs at least (the largest text/picture a command writes is well below it)
MIN_FREE_BYTES = 1 << 20
_SHOWN = 80  # characters of a long path shown in a message


def shown(value: object, limit: int = _SHOWN) -> str:
    """``value`` as text, cut to ``limit`` characters with its length when longer (long values in
    one-line messages)."""
    text = str(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}…{text[-12:]} ({len(text):,} characters)"


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number below 1,024 (``1.5 GiB``, ``3.2 EiB``)."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} bytes" if k == 0 else f"{n:.3g} {units[k]}"


def check_name_length(path: Path, flag: str) -> None:
    """One line when a component of ``path`` is longer than the file system allows."""
    raw = os.fsencode(str(path))
    if len(raw) >= PATH_MAX:
        raise ConfigError(
            f"{flag} {shown(path)}: the path is {len(raw):,} bytes, over the {PATH_MAX:,} allowed"
        )
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            raise ConfigError(
                f"{flag} {shown(path)}: the name {shown(part, 40)} is {size:,} bytes, over the {NAME_MAX} "
                "a file system allows; choose a shorter name"
            )


def check_folder_writable(folder: Path, flag: str, path: Path, need_bytes: int = MIN_FREE_BYTES) -> None:
    """``folder`` exists, is a folder, takes a new file (probe) and has ``need_bytes`` free."""
    if not folder.exists():
        raise ConfigError(f"{flag} {shown(path)}: folder {shown(folder)} does not exist; create it first")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {shown(path)}: {shown(folder)} is a file, not a folder")
    probe = folder / f".pipewright-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        pass  # a probe left by a killed process of the same id: the folder took it
    except OSError as exc:
        raise ConfigError(
            f"{flag} {shown(path)}: cannot create a file in {shown(folder)} ({exc.strerror}); "
            "choose a writable folder"
        ) from None
    else:
        os.close(fd)
    probe.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    need = max(need_bytes, MIN_FREE_BYTES)
    if free < need:
        raise ConfigError(
            f"{flag} {shown(path)}: {free / 2**20:.1f} MiB free in {shown(folder)}, writing it needs about "
            f"{need / 2**20:.1f} MiB; free disk space or choose another {flag}"
        )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def check_output(
    path: str | os.PathLike | None,
    flag: str,
    *,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike | None] = (),
    need_bytes: int = MIN_FREE_BYTES,
) -> Path | None:
    """The module docstring's rule for the output file ``path`` given as ``flag``; returns it as a Path
    (None when not given)."""
    if path is None:
        return None
    path = Path(path)
    if not str(path):
        raise ConfigError(f"{flag} needs a file name")
    check_name_length(path, flag)
    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise ConfigError(f"{flag} {shown(path)}: {exc.strerror}") from None
    if is_dir:
        raise ConfigError(f"{flag} {shown(path)} is a folder; give a file name")
    real = path.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if real == source and not overwrite:
            raise ConfigError(
                f"{flag} {shown(path)} is also this command's input; write to another file "
                "(or give --overwrite to replace the input)"
            )
        if source.is_dir() and _inside(real, source) and not overwrite:
            raise ConfigError(
                f"{flag} {shown(path)} is inside the input folder {shown(given)}, where it would be read "
                "as input; write it elsewhere (or give --overwrite)"
            )
    folder = path.parent if str(path.parent) else Path(".")
    check_folder_writable(folder, flag, path, need_bytes)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise ConfigError(
                f"{flag} {shown(path)} exists; give --overwrite to replace it, or choose another name"
            )
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            raise ConfigError(f"{flag} {shown(path)}: the file cannot be written ({exc.strerror})") from None
    return path


def check_outputs(
    paths: Iterable[tuple[str | os.PathLike | None, str]],
    *,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike | None] = (),
) -> None:
    """:func:`check_output` for each (path, flag) — a command's main file and the files beside it."""
    inputs = list(inputs)
    for path, flag in paths:
        check_output(path, flag, overwrite=overwrite, inputs=inputs)
