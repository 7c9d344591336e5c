"""The single-process reference the multi-process training tests compare against: the whole model in
one process, the whole global batch per step, the same optimizer, learning-rate schedule and clipping
as :class:`pipewright.runtime.trainer.Trainer`, then the validation loss after the last step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipewright.data import open_dataset
from pipewright.models.family import build_full
from pipewright.models.gpt import loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.runtime.config import TrainConfig


@dataclass
class Reference:
    losses: list[float]  # training loss per step
    grads0: dict[str, torch.Tensor]  # gradients of the first step, before clipping
    norms: list[float]  # global gradient norm per step (before clipping)
    val: float | None  # validation loss after the last step (None: no validation batches)
    params: dict[str, torch.Tensor]  # parameters after the last step


def single_process(
    c: TrainConfig, spec: ModelSpec | None = None, eval_batches: int | None = None
) -> Reference:
    """Train ``c.steps`` steps of ``spec`` (default ``c.model_spec()``) in this process."""
    spec = spec or c.model_spec()
    model = build_full(spec, seed=c.seed)
    params = dict(model.named_parameters())
    opt = build_optimizer(c.optimizer, params.items(), lr=c.lr, weight_decay=c.weight_decay)
    dataset = open_dataset(c.data, progress=False)
    losses, norms, grads0 = [], [], None
    for step in range(c.steps):
        x, y = dataset.batch("train", step, c.global_batch, spec.seq_len, c.seed)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        losses.append(loss.item())
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in params.items()}
        set_lr(opt, lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio))
        norms.append(float(clip_grad_norm_(list(params.values()), c.grad_clip)))
        opt.step()
    n_val = c.eval_batches if eval_batches is None else eval_batches
    val = None
    if n_val:
        with torch.no_grad():  # as Trainer.evaluate
            vals = [
                loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).item()
                for x, y in (
                    dataset.batch("val", j, c.global_batch, spec.seq_len, c.seed) for j in range(n_val)
                )
            ]
        val = sum(vals) / len(vals)
    return Reference(losses, grads0 or {}, norms, val, {n: p.detach().clone() for n, p in params.items()})
