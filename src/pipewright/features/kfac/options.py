"""The K-FAC feature's options, one declaration: training (TOML ``[kfac]``; ``pipewright train
--kfac-…``) and ``pipewright simulate --fill kfac`` with its ``--kfac-…`` flags (:mod:`.cli`).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.errors import ConfigError
from pipewright.options import option

#: ``--kfac-base``: the first-order updates the preconditioned gradient can feed (.optimizer.build_base).
BASE_UPDATES = ("sgd", "adamw", "lamb")
#: ``--kfac-fill``: what a bubble runs — the pending tasks whose measured times fit its predicted length,
#: or every pending task (what runs where then depends only on the schedule: runs repeat exactly).
FILLS = ("measured", "all")
#: ``simulate --kfac-precondition``: in each stage's tail bubble, or after the pipeline (the paper).
PRECONDITION = ("tail", "end")
_SIM = ("simulate",)


@dataclass(frozen=True)
class KfacOptions:
    """The feature's options: training (TOML ``[kfac]``; ``pipewright train --kfac-…``), used with
    ``--optimizer kfac``; and ``pipewright simulate``'s (``--fill kfac`` and its task costs)."""

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
    simulate_fill: str | None = option(
        None, "--fill", "fill the bubbles with K-FAC tasks and report", choices=("kfac",), commands=_SIM
    )
    profile: str | None = option(
        None,
        "--kfac-profile",
        "MODEL:GPU:BS of a PipeFisher profile, e.g. bert-large:v100:32",
        commands=_SIM,
    )
    precondition: str = option(
        "tail",
        "--kfac-precondition",
        "precondition in each stage's tail bubble or after the pipeline (end: the paper)",
        choices=PRECONDITION,
        commands=_SIM,
    )
    no_split: bool = option(False, "--kfac-no-split", "never split an inversion into pieces", commands=_SIM)
    unit: float = option(1.0, "--kfac-unit", "cost of each K-FAC task with --cost unit", commands=_SIM)

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
        elif config.cp > 1:
            raise ConfigError(
                f"--optimizer kfac is not supported with --cp {config.cp} yet (its curvature factors would "
                "see one slice of each sequence); use --cp 1"
            )
