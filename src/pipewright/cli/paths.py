"""Checks on the files a command will write, made before any work starts."""

from __future__ import annotations

import os
from pathlib import Path

from pipewright.errors import ConfigError


def check_writable(path: str, flag: str) -> None:
    """One-line ConfigError when ``path`` (given as ``flag``) cannot be written: its folder is missing
    or read-only, or the file exists read-only."""
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist; create it or choose another")
    if not os.access(folder, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable (permission denied); choose another path")
