"""The compute-only schedule a training config names: a schedule library name or a PyTorch-format CSV."""

from __future__ import annotations

from typing import Any

from pipewright.codec import load_csv
from pipewright.errors import ConfigError
from pipewright.ir import Schedule
from pipewright.passes import validate
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import build_schedule


def resolve_schedule(config: TrainConfig, registry: Any = None) -> Schedule:
    """Compute-only schedule for the config: a name in ``registry`` (default: the core schedule
    families) or a PyTorch-format CSV path; validated."""
    name = config.schedule
    if name.endswith(".csv"):
        sched = load_csv(name)
        if sched.lowered:
            from pipewright.passes.lower import strip_comms

            sched = strip_comms(sched)
        if sched.num_ranks != config.pp:
            raise ConfigError(f"schedule {name} has {sched.num_ranks} ranks but --pp is {config.pp}")
        if sched.num_microbatches != config.microbatches:
            raise ConfigError(
                f"schedule {name} has {sched.num_microbatches} microbatches but --microbatches is "
                f"{config.microbatches}"
            )
        if config.virtual is not None and sched.num_stages != config.pp * config.virtual:
            raise ConfigError(f"schedule {name} has {sched.num_stages} stages, not pp × virtual")
        return validate(sched)
    return validate(build_schedule(name, config.pp, config.microbatches, config.virtual, registry=registry))
