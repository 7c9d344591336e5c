"""``pipewright train --vocab-parallel naive|alg1|alg2``: the trainer's runtime parts for the feature.

:func:`check_training` runs before any worker starts and refuses, in one line each, what the runtime
does not support. :func:`runtime_parts` is the feature's ``train_runtime``; the trainer calls it on
every rank with itself as the context and gets back (:class:`~pipewright.features.RuntimeParts`):

- the schedule with the vocabulary actions inserted (:func:`~.insert.insert_vocab`, unit placement
  costs: the runtime follows the schedule's order, the durations only choose it);
- the stages without their vocabulary layers (:class:`~.runtime.VocabStage`);
- the rank's two vocabulary shards as extra parameters, named ``embed.tok.weight#vocab{q}of{n}`` and
  ``head.out.weight#vocab{q}of{n}`` (q = pp_rank·t + tp_rank): the optimizer, the global gradient norm
  and the checkpoints take them like any parameter; a checkpoint of another p·t does not load;
- the handlers of :class:`~.runtime.VocabRuntime`, the loss computed on every rank, the batch on every
  rank, and ``after_run``: complete the iteration's collectives, then average the shards' gradients
  over the data-parallel replicas (each replica has its own vocabulary group);
- ``evaluate``: the validation loss by running the training schedule and discarding the gradients
  (the vocabulary passes have no forward-only schedule; costs about 3× a forward-only pass).

Every shard starts as the rows of the full model's tables (same seed), and AdamW, weight decay and
clipping are element-wise or use the global norm, so a run's losses equal the run without the feature.
"""

from __future__ import annotations

from typing import Any

from pipewright.errors import ConfigError
from pipewright.features import RuntimeParts
from pipewright.features.vocab.options import TRAIN_CHOICES


def check_training(config: Any, spec: Any, schedule: Any) -> None:
    """One-line ConfigErrors for the combinations ``train --vocab-parallel`` does not support."""
    option = getattr(config, "vocab_parallel", "none")
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
        (spec.tied_embeddings, "tied embeddings (the shards are untied, as in the paper)"),
        (config.sequence_parallel, "--sequence-parallel"),
        (config.precision != "fp32", f"--precision {config.precision} (fp32 only)"),
        (config.shard_optimizer, "--shard-optimizer"),
        (config.optimizer == "kfac", "--optimizer kfac"),
        (config.init_from is not None, "--init-from"),
        (_async(schedule), f"the asynchronous schedule {schedule.name}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"--vocab-parallel does not support {what}; drop one of the two")
    if spec.family != "gpt":
        raise ConfigError(
            f"--vocab-parallel supports the GPT family only, not {spec.family}; use --model gpt"
        )


def _async(schedule: Any) -> bool:
    from pipewright.features import training_hook

    return training_hook(schedule) is not None


def runtime_parts(trainer: Any) -> RuntimeParts:
    """The feature's runtime factory (see the module); empty parts when the config leaves it off.
    Collective (creates the vocabulary groups)."""
    config = trainer.config
    algorithm = getattr(config, "vocab_parallel", "none")
    if algorithm == "none":
        return RuntimeParts()
    import torch.distributed as dist

    from pipewright.features.vocab.insert import insert_vocab
    from pipewright.features.vocab.runtime import VocabRuntime, VocabStage, vocab_group

    mesh, spec = trainer.mesh, trainer.spec
    schedule = insert_vocab(trainer.schedule, algorithm)
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
        prm.data = prm.data.to(trainer.device)
    tag = f"#vocab{group.index}of{group.shards}"
    params = {"embed.tok.weight" + tag: rt.embedding.weight, "head.out.weight" + tag: rt.output.weight}
    stages = {s: VocabStage(module) for s, module in trainer.stages.items()}

    def after_run() -> None:
        rt.finish()
        if mesh.dp > 1:
            for prm in params.values():
                dist.all_reduce(prm.grad, group=mesh.dp_group)
                prm.grad /= mesh.dp

    def evaluate(executor, inputs, targets) -> list[float]:
        losses = executor.run(inputs, targets)
        rt.finish()
        for module in executor.stages.values():
            module.zero_grad(set_to_none=True)
        for prm in params.values():
            prm.grad = None
        return losses

    return RuntimeParts(
        handlers=rt.handlers(),
        loss_fn_off=True,
        schedule=schedule,
        stages=stages,
        parameters=params,
        batch_everywhere=True,
        after_run=after_run,
        evaluate=evaluate,
    )
