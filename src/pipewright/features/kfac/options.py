"""The K-FAC feature's training options (TOML ``[kfac]``; ``pipewright train --kfac-…``). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.options import option

#: ``--kfac-base``: the first-order updates the preconditioned gradient can feed (.optimizer.build_base).
BASE_UPDATES = ("sgd", "adamw", "lamb")
#: ``--kfac-fill``: what a bubble runs — the pending tasks whose measured times fit its predicted length,
#: or every pending task (what runs where then depends only on the schedule: runs repeat exactly).
FILLS = ("measured", "all")


@dataclass(frozen=True)
class KfacOptions:
    """The feature's training options (TOML ``[kfac]``; ``pipewright train --kfac-…``), used with
    ``--optimizer kfac``."""

    base: str = option(
        "adamw",
        "--kfac-base",
        "with --optimizer kfac: the update it feeds, sgd, adamw or lamb",
        update_rule=True,
    )
    fill: str = option(
        "measured",
        "--kfac-fill",
        "with --optimizer kfac: measured (tasks that fit a bubble) or all (reproducible)",
    )
    opportunistic: bool = option(
        False,
        "--kfac-opportunistic",
        "with --optimizer kfac: also run pending K-FAC tasks while a receive waits",
    )

    def check(self, config) -> None:
        """One-line errors for these options in ``config`` (checked before any worker starts)."""
        if self.base not in BASE_UPDATES:
            raise ConfigError(f"--kfac-base must be one of {', '.join(BASE_UPDATES)} (got {self.base!r})")
        if self.fill not in FILLS:
            raise ConfigError(f"--kfac-fill must be one of {', '.join(FILLS)} (got {self.fill!r})")
        if config.optimizer != "kfac":
            if self.opportunistic:
                raise ConfigError("--kfac-opportunistic needs --optimizer kfac")
            for flag, value, default in (("base", self.base, "adamw"), ("fill", self.fill, "measured")):
                if value != default:
                    raise ConfigError(f"--kfac-{flag} {value} needs --optimizer kfac")
        elif config.shard_optimizer:
            raise ConfigError("--optimizer kfac does not combine with --shard-optimizer; drop one of them")
