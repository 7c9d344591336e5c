"""The composition root of training: where the core (runtime, models, data) meets the features.

:func:`prepare` checks a config in the launching process (the features' options and plugins
included) and returns a :class:`~pipewright.runtime.core.trainer.PreparedRun`; :func:`train` starts the
workers, each running :func:`train_worker` around a :class:`~pipewright.runtime.core.trainer.Trainer` with
the run's training plugins. Nothing below this package (runtime, models, data) imports a feature.
"""

from pipewright.training.prepare_run import (
    active_plugins,
    check_config,
    default_out_dir,
    prepare,
    resolve_options,
    resolve_schedule,
    run_features,
)
from pipewright.training.run_inputs import config_from_toml, config_from_values, replaced, run_spec
from pipewright.training.workers import train, train_worker

__all__ = [
    "active_plugins",
    "check_config",
    "config_from_toml",
    "config_from_values",
    "default_out_dir",
    "prepare",
    "replaced",
    "resolve_options",
    "resolve_schedule",
    "run_features",
    "run_spec",
    "train",
    "train_worker",
]
