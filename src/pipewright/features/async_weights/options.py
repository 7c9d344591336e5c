"""The asynchronous-weights feature's training options (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipewright.options import option


@dataclass(frozen=True)
class AsyncOptions:
    """The feature's training options (TOML ``[async]``), used by asynchronous schedules."""

    weight_policy: str = option(
        "stash",
        "--weight-policy",
        "asynchronous schedules: none, stash, 2bw, predict, dc or nesterov",
        update_rule=True,
    )
    window: int = option(10, "--async-window", "asynchronous schedules: steps per flush-free window")

    def check(self, config: Any) -> None:
        """A window of at least one step, for every run (a flag's range, as the core's numbers)."""
        from pipewright.values import POSITIVE, check_value

        check_value("--async-window", self.window, POSITIVE)
