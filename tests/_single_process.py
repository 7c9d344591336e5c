"""One process against many: the single-process reference the multi-process training tests compare
against, the worker that trains the same runs through the real trainer and gathers what it saw, and the
comparison of the two.

Reference (:func:`train_one_process`, :func:`single_process`): the whole model in one process, the
whole global batch per step, the same optimizer, learning-rate schedule and clipping as
:class:`pipewright.runtime.core.trainer.Trainer`, then the validation loss after the last step.

Pipelined (:func:`train_and_gather`): every rank trains each run's ``steps`` steps, one mesh per shape
shared by the runs; rank 0 gathers every rank's :class:`Observed`.

Comparison (:func:`compare`): losses (and the validation loss) within ``rtol`` elementwise, every
gradient of the first step and every parameter after the last within ``rtol`` in norm,
‖got − want‖ ≤ rtol·‖want‖ + 1e-12.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipewright.data import open_dataset
from pipewright.models.family import build_full
from pipewright.models.gpt import loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.runtime.setup.config import TrainConfig

#: (split, index) → (inputs, targets) of the whole global batch
Batches = Callable[[str, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Reference:
    losses: list[float]  # training loss per step
    grads0: dict[str, torch.Tensor]  # gradients of the first step, before clipping
    norms: list[float]  # global gradient norm per step (before clipping)
    val: float | None  # validation loss after the last step (None: no validation batches)
    params: dict[str, torch.Tensor]  # parameters after the last step


def train_one_process(
    c: TrainConfig,
    model: torch.nn.Module,
    batches: Batches,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    val_batches: int = 0,
) -> Reference:
    """Train ``model`` ``c.steps`` steps on ``batches("train", step)`` with the trainer's optimizer,
    learning rate (``lr_at``) and global-norm clipping; then the mean validation loss over
    ``val_batches`` batches (a forward-only pass, as ``Trainer.evaluate``)."""
    params = dict(model.named_parameters())
    opt = build_optimizer(c.optimizer, params.items(), lr=c.lr, weight_decay=c.weight_decay)
    losses, norms, grads0 = [], [], None
    for step in range(c.steps):
        x, y = batches("train", step)
        model.zero_grad(set_to_none=True)
        value = loss(model(x), y)
        value.backward()
        losses.append(value.item())
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in params.items()}
        set_lr(opt, lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio))
        norms.append(float(clip_grad_norm_(list(params.values()), c.grad_clip)))
        opt.step()
    val = None
    if val_batches:
        with torch.no_grad():
            vals = [loss(model(x), y).item() for x, y in (batches("val", j) for j in range(val_batches))]
        val = sum(vals) / len(vals)
    return Reference(losses, grads0 or {}, norms, val, {n: p.detach().clone() for n, p in params.items()})


def dataset_batches(c: TrainConfig, seq_len: int) -> Batches:
    """The global batches of ``c.data`` as the trainer reads them (same split, index and seed)."""
    dataset = open_dataset(c.data, progress=False)

    def batches(split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = dataset.batch(split, index, c.global_batch, seq_len, c.seed)
        return torch.from_numpy(x), torch.from_numpy(y)

    return batches


def single_process(
    c: TrainConfig, spec: ModelSpec | None = None, eval_batches: int | None = None
) -> Reference:
    """Train ``c.steps`` steps of ``spec`` (default ``c.model_spec()``) in this process."""
    spec = spec or c.model_spec()
    n_val = c.eval_batches if eval_batches is None else eval_batches
    return train_one_process(
        c, build_full(spec, seed=c.seed), dataset_batches(c, spec.seq_len), loss_fn, n_val
    )


@dataclass
class Observed:
    """What one rank saw of one pipelined run."""

    losses: list[float]  # training loss per step, then the validation loss when evaluated
    norms: list[float]  # global gradient norm per step (before clipping)
    grads: dict[str, torch.Tensor]  # this rank's gradients of the first step, tp shards gathered
    params: dict[str, torch.Tensor]  # this rank's parameters after the last step, tp shards gathered
    facts: Any  # what the test's ``facts(trainer)`` returned (None without one)


def _full(trainer: Any, grad: bool) -> dict[str, torch.Tensor]:
    """This rank's parameters (or gradients) by name, tensor-parallel shards gathered to full size."""
    from pipewright.runtime.parallel.tp import full_parameters

    return {
        name: t.clone()
        for stage in trainer.stages.values()
        for name, t in full_parameters(stage, grad=grad).items()
    }


def train_and_gather(
    rank: int, runs: list, facts: Callable[[Any], Any] | None = None, evaluate: bool = True
) -> list[list[Observed]] | None:
    """Spawned worker: each run (a ``PreparedRun``) through :class:`Trainer` for ``steps`` steps, then
    (``evaluate``) its validation loss; rank 0 returns, per run, every rank's :class:`Observed`."""
    from pipewright.runtime.core.trainer import Trainer
    from pipewright.runtime.parallel.process_mesh import ParallelMesh

    torch.set_num_threads(1)
    results, meshes = [], {}
    for run in runs:
        c = run.config
        shape = (c.dp, c.pp, c.tp, c.cp)
        if shape not in meshes:  # one mesh (and its process groups) per shape
            meshes[shape] = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp)
        trainer = Trainer(run, mesh=meshes[shape])
        losses = [trainer.forward_backward(0)]
        if trainer.master is not None and trainer.master.shard:  # only slices are reduced: gather them
            trainer.master.gather_grads_()
        grads = _full(trainer, grad=True)
        norms = [trainer.optimizer_step(0)[1]]
        for step in range(1, c.steps):
            losses.append(trainer.forward_backward(step))
            norms.append(trainer.optimizer_step(step)[1])
        params = _full(trainer, grad=False)
        if evaluate:
            losses.append(trainer.evaluate())  # forward-only pass through the placement's stages
        seen = Observed(losses, [float(n) for n in norms], grads, params, facts(trainer) if facts else None)
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(seen, gathered, dst=0)
        results.append(gathered)
    return results if rank == 0 else None


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """‖got − want‖ ≤ rtol·‖want‖ + 1e-12."""
    return float((got - want).norm()) <= rtol * float(want.norm()) + 1e-12


def compare(
    label: str,
    observed: Iterable[Observed],
    want: Reference,
    rtol: float,
    *,
    rename: Callable[[str], str] = str,
    norms: bool = False,
) -> tuple[list[str], dict[str, int]]:
    """(failures, how many ranks held each parameter) of every rank's :class:`Observed` against the
    one-process ``want``: losses (then the validation loss when ``want.val`` is set) and, with
    ``norms``, the gradient norms elementwise within ``rtol``; each gradient of the first step and
    each final parameter by :func:`close`. ``rename`` maps the pipeline's parameter names to
    ``want``'s (counted under ``want``'s name)."""
    want_losses = want.losses if want.val is None else [*want.losses, want.val]
    failures: list[str] = []
    seen: dict[str, int] = defaultdict(int)
    for got in observed:
        if not np.allclose(got.losses, want_losses, rtol=rtol, atol=0):
            failures.append(f"{label}: losses {got.losses} != {want_losses}")
        if norms and not np.allclose(got.norms, want.norms, rtol=rtol, atol=0):
            failures.append(f"{label}: gradient norms {got.norms} != {want.norms}")
        for name, g in got.grads.items():
            theirs = rename(name)
            seen[theirs] += 1
            if not close(g, want.grads0[theirs], rtol):
                failures.append(f"{label}: gradient of {name} differs")
            if not close(got.params[name], want.params[theirs], rtol):
                failures.append(f"{label}: {name} differs after {len(want.losses)} steps")
    return failures, seen
