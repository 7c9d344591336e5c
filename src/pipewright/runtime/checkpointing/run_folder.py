"""Protected run folders: a training run never writes into another run's folder by accident.

- An ``--out`` that already holds a run (``metrics.jsonl``, ``config.json`` or ``checkpoints/``) is
  refused unless ``--resume`` (continue it) or ``--overwrite`` (move it aside to
  ``<out>.replaced-<UTC time>``, never delete it) is given.
- A lock file ``<out>/.pipewright.lock`` (JSON: pid, host, start time, torchrun job id) is held for the
  run's life. A second run into the folder is refused in one line naming the holder; a lock whose
  process is dead (same host) is taken over with a warning; a torchrun restart of the same job
  (``TORCHELASTIC_RUN_ID``, else the agent's store address ``MASTER_ADDR:MASTER_PORT``) continues
  under its own lock.
- Default folders (``runs/<UTC time>``) are created with an exclusive ``mkdir``, so two runs started
  in the same second get two folders (``…-1``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipewright.errors import ConfigError
from pipewright.outputs import check_name_length, shown

log = logging.getLogger(__name__)

LOCK_NAME = ".pipewright.lock"
RUN_FILES = ("metrics.jsonl", "config.json", "checkpoints")


def holds_run(folder: Path) -> list[str]:
    """The run files ``folder`` holds (empty: not a run folder)."""
    return [name for name in RUN_FILES if (folder / name).exists()]


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


_LOOPBACK = ("127.", "localhost", "::1")


def _job_id(env: Mapping[str, str] = os.environ, host: str | None = None) -> str | None:
    """What every attempt of one torchrun job shares: ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``; a fresh
    id under ``--standalone``), else the address of the agent's store (``MASTER_ADDR:MASTER_PORT``),
    which torchrun's rendezvous (static and c10d) creates once and keeps bound for the whole job, so no
    other live job has it (a loopback address is qualified by the host). None outside torchrun."""
    job = env.get("TORCHELASTIC_RUN_ID")
    if job not in (None, "", "none"):
        return job
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if job is None or not addr or not port:
        return None
    if addr.startswith(_LOOPBACK):
        addr = f"{host or socket.gethostname()}/{addr}"
    return f"store {addr}:{port}"


def _alive(pid: int) -> bool:
    if pid <= 0:  # never probe process groups (kill(0|-1, 0))
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the process holding it."""

    pid: int
    host: str
    started: str
    job: str | None

    @classmethod
    def current(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), _stamp(), _job_id())

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host} (since {self.started} UTC)"

    def is_me(self) -> bool:
        me = Holder.current()
        return (self.host == me.host and self.pid == me.pid) or (self.job is not None and self.job == me.job)

    def is_dead(self) -> bool:
        """Known dead: on this host and no such process."""
        return self.host == socket.gethostname() and not _alive(self.pid)


def read_lock(folder: Path) -> Holder | None:
    path = folder / LOCK_NAME
    try:
        data = json.loads(path.read_text())
        return Holder(int(data["pid"]), str(data["host"]), str(data.get("started", "?")), data.get("job"))
    except OSError:  # no lock (or no folder yet)
        return None
    except (ValueError, KeyError, TypeError):  # half-written: a holder that died while writing it
        return Holder(0, socket.gethostname(), "?", None)


def _check_holder(folder: Path) -> Holder | None:
    """The folder's holder when it is this process (or job); raise when a live other process holds it."""
    holder = read_lock(folder)
    if holder is None or holder.is_me() or holder.is_dead():
        return holder
    raise ConfigError(
        f"--out {folder} is in use by {holder.describe()}; wait for it, choose another --out, or delete "
        f"{folder / LOCK_NAME} if that process is gone"
    )


def check_out(folder: Path, *, resume: bool, overwrite: bool) -> None:
    """Before any work: refuse a folder another live run holds, or that holds a run when neither
    ``resume`` nor ``overwrite`` is given (a restart of the run holding it passes)."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite moves it aside; give one")
    check_name_length(folder, "--out")
    if not str(folder) or folder.is_file() or (folder.is_symlink() and not folder.is_dir()):
        raise ConfigError(f"--out {shown(folder)} is not a folder; give a folder for the run (new or a run)")
    holder = _check_holder(folder)
    if holder is not None and holder.is_me():
        return
    found = holds_run(folder)
    if found and not resume and not overwrite:
        raise ConfigError(
            f"--out {folder} already holds a run ({', '.join(found)}); continue it with --resume, move it "
            "aside with --overwrite, or choose another --out"
        )


def move_aside(folder: Path) -> Path:
    """Rename ``folder`` to ``<folder>.replaced-<UTC time>[-n]`` (never deletes); returns the new path."""
    base = folder.with_name(f"{folder.name}.replaced-{_stamp()}")
    target, n = base, 1
    while target.exists():
        target, n = base.with_name(f"{base.name}-{n}"), n + 1
    try:
        os.rename(folder, target)
    except OSError as exc:
        raise ConfigError(f"--overwrite: cannot move {folder} aside to {target}: {exc.strerror}") from None
    return target


def new_run_dir(root: Path) -> Path:
    """A fresh ``root/<UTC time>`` folder, created exclusively (``-1``, ``-2``… within one second)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp, n = _stamp(), 0
    while True:
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


class RunLock:
    """The lock of one run folder, held from :meth:`acquire` to :meth:`release` (or the process's end:
    a dead holder's lock is taken over by the next run)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        me = Holder.current()
        record = json.dumps({"pid": me.pid, "host": me.host, "started": me.started, "job": me.job})
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _check_holder(self.folder)  # raises when a live other process holds it
                if holder is not None and not holder.is_me():
                    log.warning(
                        "warning: %s held a stale lock on %s (the process is gone); taking it over",
                        holder.describe(),
                        self.folder,
                    )
                self.path.unlink(missing_ok=True)
                time.sleep(0.01)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(record)
            self.held = True
            return self
        raise ConfigError(f"--out {self.folder}: could not take the lock {self.path}; try again")

    def release(self) -> None:
        if self.held:
            holder = read_lock(self.folder)
            if holder is not None and holder.is_me():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(folder: Path | None, root: Path, *, resume: bool, overwrite: bool) -> tuple[Path, RunLock]:
    """Take the run folder: a new default folder under ``root`` when ``folder`` is None; else
    :func:`check_out` it, move an old run aside under ``overwrite``, and lock it."""
    if folder is None:
        path = new_run_dir(root)
        return path, RunLock(path).acquire()
    check_out(folder, resume=resume, overwrite=overwrite)
    holder = read_lock(folder)
    if overwrite and holds_run(folder) and not (holder is not None and holder.is_me()):
        moved = move_aside(folder)
        log.warning("warning: --overwrite: moved the previous run in %s to %s", folder, moved)
    return folder, RunLock(folder).acquire()


def no_checkpoint_advice(folder: Path, skipped: list[str]) -> str:
    """The one line for ``--resume`` without a usable checkpoint: what was skipped, and a way on that
    keeps what the folder holds (never "run without --resume", which would write over it)."""
    why = f" ({'; '.join(skipped)})" if skipped else ""
    found = holds_run(folder)
    if found:
        way = "start again with --overwrite (moves this run aside) or choose another --out"
    else:
        way = "run without --resume to start it"
    return f"--resume: no checkpoint to resume in {folder / 'checkpoints'}{why}; {way}"
