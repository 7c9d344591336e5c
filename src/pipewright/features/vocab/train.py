"""``pipewright train --vocab-parallel naive|alg1|alg2``: the feature's training plugin.

:meth:`VocabPlugin.check` runs before any worker starts and refuses, in one line each, what the runtime
does not support. On every rank (:mod:`pipewright.runtime.core.plugin`), the build call gives:

- the schedule with the vocabulary actions inserted (:func:`~.insert.insert_vocab`, unit placement
  costs: the runtime follows the schedule's order, the durations only choose it);
- the stages without their vocabulary layers (:class:`~.runtime.VocabStage`);
- the rank's two vocabulary shards as extra parameters, named ``embed.tok.weight#vocab{q}of{n}`` and
  ``head.out.weight#vocab{q}of{n}`` (q = pp_rank·t + tp_rank): the optimizer, the global gradient norm
  and the checkpoints take them like any parameter; a checkpoint of another p·t does not load;
- the loss computed on every rank (by the vocabulary handlers), the batch given to every rank;

then the executor parts are the handlers of :class:`~.runtime.VocabRuntime`; ``after_run``: complete
the iteration's collectives, then average the shards' gradients over the data-parallel replicas (each
replica has its own vocabulary group); ``evaluate``: the validation loss by running the training
schedule and discarding the gradients (the vocabulary passes have no forward-only schedule; costs
about 3× a forward-only pass).

Every shard starts as the rows of the full model's tables (same seed), and AdamW, weight decay and
clipping are element-wise or use the global norm, so a run's losses equal the run without the feature.
"""

from __future__ import annotations

from typing import Any

from pipewright.errors import ConfigError
from pipewright.features.vocab.options import TRAIN_CHOICES, VocabOptions
from pipewright.options import section_of
from pipewright.runtime.core.plugin import (
    BuildContext,
    Built,
    ExecutorParts,
    OptimizerContext,
    TrainingPlugin,
)


def check_training(config: Any, spec: Any, schedule: Any) -> None:
    """One-line ConfigErrors for the combinations ``train --vocab-parallel`` does not support (``spec``
    None: before the model is known)."""
    option = section_of(config, VocabOptions).parallel
    if option == "none":
        return
    if option == "redistribute":
        raise ConfigError(
            "--vocab-parallel redistribute is a layout, not a runtime method: give the layout with --layout "
            "(e.g. fewer layers on the first and last stages)"
        )
    if option not in TRAIN_CHOICES:
        raise ConfigError(f"--vocab-parallel {option!r}; choose one of {', '.join(TRAIN_CHOICES)}")
    unsupported = [
        (
            spec is not None and spec.tied_embeddings,
            "tied embeddings (the shards are untied, as in the paper)",
        ),
        (config.sequence_parallel, "--sequence-parallel"),
        (config.precision != "fp32", f"--precision {config.precision} (fp32 only)"),
        (config.shard_optimizer, "--shard-optimizer"),
        (config.optimizer == "kfac", "--optimizer kfac"),
        (config.init_from is not None, "--init-from"),
        (not schedule.meta.get("flush", True), f"the asynchronous schedule {schedule.name}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"--vocab-parallel does not support {what}; drop one of the two")
    if spec is not None and spec.family != "gpt":
        raise ConfigError(
            f"--vocab-parallel supports the GPT family only, not {spec.family}; use --model gpt"
        )


class VocabPlugin(TrainingPlugin):
    """The feature's training plugin (see the module)."""

    @classmethod
    def active(cls, config: Any, schedule: Any) -> bool:
        return section_of(config, VocabOptions).parallel != "none"

    @classmethod
    def check(cls, config: Any, schedule: Any, spec: Any) -> None:
        _refuse_cp(config, "--vocab-parallel")
        check_training(config, spec, schedule)

    def build(self, ctx: BuildContext) -> Built:
        """Collective (creates the vocabulary groups)."""
        import torch.distributed as dist

        from pipewright.features.vocab.insert import insert_vocab
        from pipewright.features.vocab.runtime import VocabRuntime, VocabStage, vocab_group

        config, mesh, spec = ctx.config, ctx.mesh, ctx.spec
        algorithm = section_of(config, VocabOptions).parallel
        schedule = insert_vocab(ctx.schedule, algorithm)
        group = vocab_group(mesh)
        rt = VocabRuntime(
            spec,
            group,
            algorithm=algorithm,
            seed=config.seed,
            microbatch_shape=(config.microbatch_size, spec.seq_len),
            last_rank=schedule.rank_of(schedule.num_stages - 1),
        )
        for prm in rt.parameters():
            prm.data = prm.data.to(ctx.device)
        tag = f"#vocab{group.index}of{group.shards}"
        self.rt, self.mesh, self.dist = rt, mesh, dist
        self.params = {
            "embed.tok.weight" + tag: rt.embedding.weight,
            "head.out.weight" + tag: rt.output.weight,
        }
        stages = {s: VocabStage(module) for s, module in ctx.stages.items()}
        return Built(
            schedule=schedule,
            stages=stages,
            parameters=self.params,
            batch_everywhere=True,
            computes_loss=True,
        )

    def executor_parts(self, ctx: OptimizerContext) -> ExecutorParts:
        return ExecutorParts(handlers=self.rt.handlers())

    def after_run(self) -> None:
        self.rt.finish()
        if self.mesh.dp > 1:
            for prm in self.params.values():
                self.dist.all_reduce(prm.grad, group=self.mesh.dp_group)
                prm.grad /= self.mesh.dp

    def evaluate(self, executor: Any, inputs: Any, targets: Any) -> list[float]:
        losses = executor.run(inputs, targets)
        self.rt.finish()
        for module in executor.stages.values():
            module.zero_grad(set_to_none=True)
        for prm in self.params.values():
            prm.grad = None
        return losses


def _refuse_cp(config: Any, flag: str) -> None:
    """One line: the vocabulary groups span dp × tp ranks of one sequence, not cp's slices."""
    cp = config.cp
    if cp > 1:
        raise ConfigError(
            f"{flag} is not supported with --cp {cp} yet (its groups hold whole sequences); use --cp 1"
        )
