"""Fault injection for the reliability tests and the fault table of docs/reliability.md.

Faults are read from the environment variable ``PIPEWRIGHT_FAULTS`` (inherited by spawned workers and
by torchrun's), so a test can break a real run without any test-only code path in the trainer::

    PIPEWRIGHT_FAULTS="kill:rank=1:step=3:pos=5;nan:stage=1:step=2"

One fault per ``;``-separated item: ``kind:key=value:...``. Kinds:

* ``kill``      SIGKILL this process at ``step`` (at schedule position ``pos``, default: mid-iteration);
* ``term``      send SIGTERM to this process at ``step`` (preemption from inside);
* ``kill-save`` SIGKILL this process while the checkpoint of ``step`` is being written (shards on disk,
  not yet renamed);
* ``nan``       write NaN into the first gradient of stage ``stage`` after the backward of ``step``;
* ``hang``      sleep forever at ``step``, schedule position ``pos`` (default 0);
* ``pause``     wait ``ms`` milliseconds at ``step``, position ``pos`` (default 0), or until a SIGTERM
  arrives (a test's window to preempt a run at a known step);
* ``stall-reduce`` wait ``ms`` milliseconds (or until a SIGTERM) before this rank's data-parallel
  gradient all-reduce (REDUCE_GRAD) of ``step``: its dp peers wait in the all-reduce (a collective hang);
* ``stall-save`` wait ``ms`` milliseconds (or until a SIGTERM) when this rank starts writing its shards
  of the checkpoint of ``step``: the other ranks wait in DCP's collective (a hang in a save);
* ``stall-eval`` wait ``ms`` milliseconds (or until a SIGTERM) at position ``pos`` (default 0) of the
  evaluation after ``step`` steps (a hang in an evaluation).

Keys: ``rank`` (global rank; default: every rank, for ``nan`` the ranks holding the stage), ``step``
(0-based training step; for ``kill-save``, ``stall-save`` and ``stall-eval`` the number of steps done:
the checkpoint's, or the one the evaluation follows), ``pos``, ``stage``,
``ms``, ``attempt`` (the restart count the fault fires in; default 0, the first attempt, so a restarted group
does not meet the same fault again).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.ir import REDUCE_GRAD

ENV = "PIPEWRIGHT_FAULTS"
#: restart count set by ``pipewright train``'s own launcher (torchrun sets TORCHELASTIC_RESTART_COUNT)
RESTART_ENV = "PIPEWRIGHT_RESTART_COUNT"
KINDS = ("kill", "term", "kill-save", "nan", "hang", "pause", "stall-reduce", "stall-save", "stall-eval")
_KEYS = ("rank", "step", "pos", "stage", "ms", "attempt")


def restart_count() -> int:
    """How many times the worker group has been restarted (0 in the first attempt)."""
    for name in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    pos: int | None = None
    stage: int | None = None
    ms: int = 0
    attempt: int = 0


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse the ``PIPEWRIGHT_FAULTS`` syntax (module docstring); one-line ConfigError when malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(f"{ENV}: unknown fault {kind!r}; choose one of {', '.join(KINDS)}")
        values: dict[str, int] = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if key not in _KEYS or not eq or not value.lstrip("-").isdigit():
                raise ConfigError(f"{ENV}: cannot read {pair!r} in {item!r}; write key=integer, keys {_KEYS}")
            values[key] = int(value)
        if "step" not in values:
            raise ConfigError(f"{ENV}: fault {item!r} needs step=N")
        faults.append(Fault(kind, **values))
    return tuple(faults)


class FaultPlan:
    """This process's faults (those of its rank and restart attempt) and the hooks that fire them."""

    def __init__(
        self,
        faults: Iterable[Fault],
        rank: int,
        attempt: int | None = None,
        wake: threading.Event | None = None,
    ) -> None:
        attempt = restart_count() if attempt is None else attempt
        self.rank = rank
        self.wake = wake or threading.Event()
        self.faults = [f for f in faults if f.attempt == attempt and f.rank in (None, rank)]

    @classmethod
    def from_env(cls, rank: int, wake: threading.Event | None = None) -> FaultPlan:
        """The faults of ``PIPEWRIGHT_FAULTS``; ``wake`` (set by SIGTERM) ends a ``pause`` early."""
        return cls(parse_faults(os.environ.get(ENV, "")), rank, wake=wake)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _take(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.step == step]

    def _stall(self, kind: str, step: int, position: int | None = None) -> None:
        """Wait as the first due ``kind`` fault says (at ``position``: its ``pos``, default 0), once."""
        for f in self._take(kind, step):
            if position is None or position == (f.pos or 0):
                self.faults.remove(f)
                self.wake.wait(f.ms / 1000)
                return

    def at_action(
        self, step: int, position: int, num_actions: int, kind: str = "", phase: str = "schedule"
    ) -> None:
        """Before the action at ``position`` (of kind ``kind``) of ``step``'s schedule row: kill, term,
        pause, stall or hang here. ``phase`` "evaluate": the row of the evaluation after ``step`` steps
        (only ``stall-eval`` fires there)."""
        if phase == "evaluate":
            self._stall("stall-eval", step, position)
            return
        if kind == REDUCE_GRAD:
            self._stall("stall-reduce", step)  # once: the first REDUCE_GRAD of the step
        for f in self._take("kill", step):
            if position == (num_actions // 2 if f.pos is None else f.pos):
                os.kill(os.getpid(), signal.SIGKILL)
        for f in self._take("term", step):
            if position == (f.pos or 0):
                self.faults.remove(f)
                os.kill(os.getpid(), signal.SIGTERM)
        for f in self._take("pause", step):
            if position == (f.pos or 0):
                self.wake.wait(f.ms / 1000)
        for f in self._take("hang", step):
            if position == (f.pos or 0):
                while True:  # until the launcher terminates this process
                    time.sleep(3600)

    def in_save(self, step: int, stage: str) -> None:
        """At ``stage`` (:data:`pipewright.runtime.checkpointing.checkpoint.SAVE_STAGES`) of the save of
        checkpoint
        ``step``: ``stall-save`` as this rank starts writing its shards ("write"), ``kill-save`` once
        every rank's shards are written, before the commit ("commit")."""
        if stage == "write":
            self._stall("stall-save", step)
        if stage == "commit" and self._take("kill-save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def corrupt_gradients(self, step: int, stage_params: dict[int, list]) -> None:
        """NaN into the first gradient of the faulted stage (``stage_params``: this rank's stages'
        parameters, in order), after ``step``'s backward."""
        for f in self._take("nan", step):
            for p in stage_params.get(f.stage if f.stage is not None else -1, []):
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    break
