"""The training-plugin protocol: how a feature takes part in a training run.

A plugin is one object per rank and run, made by its class from the run's config
(``cls(config)``); the class is registered in a feature bundle (:class:`pipewright.features.Feature`)
and given to the trainer by the composition root (:mod:`pipewright.training`), so the runtime names no
feature. The :class:`~pipewright.runtime.core.trainer.Trainer` makes these calls, in this order, each once,
on every plugin in registration order:

1. ``check(config, spec, schedule)`` (class method, in the launching process before any worker
   starts): one-line ConfigErrors for what the feature does not support;
2. ``build(ctx: BuildContext) -> Built``: rewrite the schedule, replace the stage modules, add
   parameters — each plugin sees the previous one's result (one owner per rewrite, one visible order);
3. ``optimizer(ctx: OptimizerContext) -> optimizer``: wrap or replace the default optimizer (return
   ``ctx.optimizer`` to keep it);
4. ``executor_parts(ctx: OptimizerContext) -> ExecutorParts``: exactly the executor's extension
   arguments (handlers, output hooks, tensor specs, groups, handler wrappers);
5. during the run: ``after_run()`` after each executor run, ``evaluate(executor, inputs, targets)``
   (None: the default forward-only pass), ``extra_state()`` for checkpoints, and
   ``train_step(trainer, step)`` for a plugin that runs the step itself (None: the trainer's step).

Every context is complete when a plugin sees it: nothing is built after the call that the call would
need. ``active(config, schedule)`` says whether the plugin takes part in a run at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipewright.errors import ConfigError


@dataclass(frozen=True)
class BuildContext:
    """What the build call sees: the run (config, spec, layout), this rank's mesh, device, the schedule
    so far, the stage modules so far and the tensor shape entering a stage."""

    run: Any
    mesh: Any
    device: Any
    schedule: Any
    stages: Mapping[int, Any]
    boundary_shape: tuple[int, ...]

    @property
    def config(self) -> Any:
        return self.run.config

    @property
    def spec(self) -> Any:
        return self.run.spec


@dataclass(frozen=True)
class Built:
    """A plugin's build result. ``schedule``/``stages``: replacements (None: unchanged);
    ``parameters`` (name → parameter): trained with the stages (optimizer, global gradient norm,
    checkpoints); ``batch_everywhere``: every rank gets the microbatches' inputs and targets;
    ``computes_loss``: the plugin computes the loss itself (the default loss hook is not installed)."""

    schedule: Any = None
    stages: Mapping[int, Any] | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    batch_everywhere: bool = False
    computes_loss: bool = False


@dataclass(frozen=True)
class OptimizerContext:
    """The finished build: ``build`` (the context after every plugin's build), ``params`` (all trained
    parameters by name), ``optimizer`` (the default, or the previous plugin's), ``master`` (the fp32
    master optimizer of mixed precision / ZeRO-1, or None), ``options`` (the
    :class:`~pipewright.runtime.core.train_options.TrainingOptions`)."""

    build: BuildContext
    params: Mapping[str, Any]
    optimizer: Any
    master: Any
    options: Any

    @property
    def config(self) -> Any:
        return self.build.config


@dataclass(frozen=True)
class ExecutorParts:
    """The executor's extension arguments (:class:`~pipewright.runtime.core.executor.PipelineExecutor`):
    ``handlers`` (kind → ``fn(state, action)``), ``output_hooks`` (stage → ``fn(state, action, output)``),
    ``tensor_specs`` (P2P tensor name → ``fn(action) -> (shape, dtype)``), ``groups`` (name → process
    group), ``handler_wrappers`` (``fn(kind, handler) -> handler``, first one innermost) and
    ``step_reduces_gradients`` (the STEP the parts install all-reduces over dp itself)."""

    handlers: Mapping[str, Callable] = field(default_factory=dict)
    output_hooks: Mapping[int, Callable] = field(default_factory=dict)
    tensor_specs: Mapping[str, Callable] = field(default_factory=dict)
    groups: Mapping[str, Any] = field(default_factory=dict)
    handler_wrappers: tuple[Callable, ...] = ()
    step_reduces_gradients: bool = False

    def merged(self, other: ExecutorParts) -> ExecutorParts:
        """Both parts; a name two of them provide is a one-line ConfigError."""
        for name in ("handlers", "output_hooks", "tensor_specs", "groups"):
            clash = set(getattr(self, name)) & set(getattr(other, name))
            if clash:
                raise ConfigError(f"two features both provide {name} for {sorted(map(str, clash))}")
        return ExecutorParts(
            {**self.handlers, **other.handlers},
            {**self.output_hooks, **other.output_hooks},
            {**self.tensor_specs, **other.tensor_specs},
            {**self.groups, **other.groups},
            self.handler_wrappers + other.handler_wrappers,
            self.step_reduces_gradients or other.step_reduces_gradients,
        )

    def executor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~pipewright.runtime.core.executor.PipelineExecutor`."""
        return {
            "handlers": dict(self.handlers),
            "output_hooks": dict(self.output_hooks),
            "tensor_specs": dict(self.tensor_specs),
            "groups": dict(self.groups),
            "handler_wrappers": list(self.handler_wrappers),
            "step_reduces_gradients": self.step_reduces_gradients,
        }


class TrainingPlugin:
    """Base class of training plugins: every call does nothing (see the module for the order)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    def active(cls, config: Any, schedule: Any) -> bool:
        """Whether the plugin takes part in a run of ``config`` on ``schedule``."""
        return True

    @classmethod
    def check(cls, config: Any, spec: Any, schedule: Any) -> None:
        """One-line ConfigErrors, in the launching process before any worker starts."""

    def build(self, ctx: BuildContext) -> Built:
        return Built()

    def optimizer(self, ctx: OptimizerContext) -> Any:
        return ctx.optimizer

    def executor_parts(self, ctx: OptimizerContext) -> ExecutorParts:
        return ExecutorParts()

    def after_run(self) -> None:
        """After each executor run (complete the plugin's collectives, reduce its gradients)."""

    def evaluate(self, executor: Any, inputs: Any, targets: Any) -> list[float] | None:
        """Validation losses of one batch, or None for the executor's forward-only pass."""
        return None

    def extra_state(self) -> Any:
        """State checkpoints carry beyond parameters and optimizer slots
        (:class:`~pipewright.runtime.checkpointing.checkpoint.ExtraState`), or None."""
        return None

    def train_step(self, trainer: Any, step: int) -> dict | None:
        """Run step ``step`` on the finished ``trainer`` and return its metrics record, or None for
        the trainer's own step."""
        return None


def merge_built(first: Built, then: Built) -> Built:
    """``then`` applied after ``first``; two plugins replacing the stage modules is a ConfigError
    (a schedule rewrite composes: the later plugin saw the earlier one's schedule)."""
    if first.stages is not None and then.stages is not None:
        raise ConfigError("two features both replace the stage modules; enable only one")
    clash = set(first.parameters) & set(then.parameters)
    if clash:
        raise ConfigError(f"two features both add parameters {sorted(clash)}")
    return Built(
        then.schedule if then.schedule is not None else first.schedule,
        then.stages if then.stages is not None else first.stages,
        {**first.parameters, **then.parameters},
        first.batch_everywhere or then.batch_everywhere,
        first.computes_loss or then.computes_loss,
    )
