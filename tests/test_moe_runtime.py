"""Mixture-of-experts training through the real trainer equals one process, auxiliary losses included.

Four processes, one spawn: pp = 2 × dp = 2 with expert parallelism ep = 2 carved from dp, and
pp = 2 × dp = 2 without it, each over 1F1B, interleaved 1F1B, ZB-H1 (split backward: the experts'
weight gradients deferred to W) and DualPipeV (with ep = 2 its F&B pairs overlapped: one microbatch's
all-to-alls on one thread while the other microbatch computes on another, checked to have run);
with ep = 2 also ZB-H2, ZB-V and 1F1B-overlap (1F1B's order, each steady-state forward paired with
a backward and overlapped as DualPipeV's, checked to have run on pipeline rank 0); pp = 2 × tp = 2
(experts split column/row-parallel like the dense MLP) and tp = 2 × dp = 2 with ep = 2, over 1F1B;
pp = 2 × cp = 2 over DualPipeV (each cp rank routes its own tokens, the balance counts summed over
cp; the F&B pairs overlapped); dp = 2 × cp = 2 with ep = 2 over 1F1B (the dense gradients reduced
once over dp × cp, the experts' once over their expert-dp × cp group).
The models: a GPT with 4 experts (top-2, dropless) and a Llama with 4 SwiGLU experts (top-2), a shared
expert, a dense first layer and capacity factor 1 (tokens dropped); load-balancing coefficient 0.1 and
z-loss 0.01, large enough that a wrong scale of their gradients shows. Checked against a single
process that runs the global batch's microbatches one after another (the auxiliary losses are per
microbatch, as in the pipeline): the loss and the auxiliary loss of each of 3 steps, every gradient of
the first step, every parameter after the last (SGD with momentum, warm-up and clipping), within 1e-5
relative in fp32 — on every rank, for every parameter it holds (under ep: its own experts).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _queue_spawn import fork_launch
from _single_process import Observed, Reference, compare
from pipewright.data import open_dataset
from pipewright.data.tokens import write_tokens
from pipewright.models.family import build_full
from pipewright.models.gpt import loss_fn
from pipewright.models.moe_mlp import moe_layers
from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import full_parameters
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import prepare

STEPS = 3
RTOL = 1e-5
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")
EP_ONLY = ("zb-h2", "zbv", "1f1b-overlap")  # with ep = 2 only (test time)
#: schedules whose F&B pairs run on two threads where ep or cp > 1 (no tp): the pipeline ranks that
#: hold pairs (1f1b-overlap: all but the last) overlap at least one each step, the others none
PAIRED = {"dualpipev": (0, 1), "1f1b-overlap": (0,)}
MOE = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}


def _cases(data: str, out: str) -> list[TrainConfig]:
    base = TrainConfig(
        pp=2, dp=2, microbatches=4, microbatch_size=1, steps=STEPS, lr=0.05, warmup=1, grad_clip=0.5,
        optimizer="sgd", data=data, progress=False, artifacts=False, eval_every=0, recv_timeout_s=120,
        vocab=256, out=out, **MOE,
    )  # fmt: skip
    models = {"gpt": {"model": "gpt-moe-tiny"}, "llama": {"model": "llama-moe-tiny", "moe_capacity": 1.0}}
    cases = []
    for ep in (2, 1):
        for i, name in enumerate(SCHEDULES + (EP_ONLY if ep > 1 else ())):
            family = ("gpt", "llama")[(i + ep) % 2]  # each schedule meets both families over ep ∈ {1, 2}
            cases.append(replace(base, schedule=name, ep=ep, **models[family]))
    tp = replace(base, schedule="1f1b", tp=2, **models["gpt"])
    cp = replace(base, schedule="dualpipev", dp=1, cp=2, microbatches=8, **models["gpt"])
    # dp = 2 × cp = 2 with ep = 2: dense gradients over dp × cp, experts' over expert-dp × cp, once each
    ep_cp = replace(base, schedule="1f1b", pp=1, ep=2, cp=2, **models["gpt"])
    return [*cases, replace(tp, dp=1, microbatches=8), replace(tp, pp=1, ep=2, **models["llama"]), cp, ep_cp]


def _worker(rank: int, runs: list[PreparedRun]) -> list | None:
    meshes, results = {}, []
    for run in runs:
        c = run.config
        shape = (c.dp, c.pp, c.tp, c.ep, c.cp)
        if shape not in meshes:
            meshes[shape] = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp, ep=c.ep, cp=c.cp)
        trainer = Trainer(run, mesh=meshes[shape])
        losses, aux = [], []
        for step in range(c.steps):
            losses.append(trainer.forward_backward(step))
            aux.append(trainer.moe.report()["moe_aux_loss"])
            if step == 0:
                grads = _full(trainer, grad=True)
            trainer.optimizer_step(step)
        params = _full(trainer, grad=False)
        pairs = trainer.moe.pair_overlap or (trainer.context and trainer.context.pair_overlap)
        overlapped = pairs.pairs_overlapped if pairs is not None else 0
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        syncs = trainer.context.grad_syncs if trainer.context is not None else 0  # all-reduces over cp alone
        facts = (overlapped, trainer.mesh.pp_rank, syncs)
        dist.gather_object((losses, aux, grads, params, facts), gathered, dst=0)
        results.append(gathered)
    return results if rank == 0 else None


def _full(trainer: Trainer, grad: bool) -> dict[str, torch.Tensor]:
    """This rank's parameters (or gradients, where it has them) by name, tp shards gathered."""
    return {
        name: t.clone()
        for stage in trainer.stages.values()
        for name, t in full_parameters(stage, grad=grad).items()
        if t is not None
    }


def _reference(c: TrainConfig, spec) -> tuple[list[float], list[float], dict, dict]:
    """One process: each step's global batch as dp·m microbatches in turn, every loss (main and
    auxiliary) scaled by 1/(dp·m); the same optimizer, learning rate and clipping as the trainer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_one_process(c, spec)
    finally:
        torch.set_num_threads(threads)


def _train_one_process(c: TrainConfig, spec) -> tuple[list[float], list[float], dict, dict]:
    model = build_full(spec, seed=c.seed)
    params = dict(model.named_parameters())
    opt = build_optimizer(c.optimizer, params.items(), lr=c.lr, weight_decay=c.weight_decay)
    dataset = open_dataset(c.data, progress=False)
    layers = moe_layers(model)
    n = c.dp * c.microbatches
    losses, auxes, grads0 = [], [], None
    for step in range(c.steps):
        x, y = dataset.batch("train", step, c.global_batch, spec.seq_len, c.seed)
        model.zero_grad(set_to_none=True)
        for layer in layers:
            layer.aux_grad_scale = 1.0 / n
            layer.records.clear()
        total = 0.0
        for xs, ys in zip(
            torch.from_numpy(x).split(c.microbatch_size),
            torch.from_numpy(y).split(c.microbatch_size),
            strict=True,
        ):
            loss = loss_fn(model(xs), ys)
            (loss / n).backward()
            total += loss.item() / n
        a, b = spec.moe_aux_loss_coeff, spec.moe_z_loss_coeff
        auxes.append(sum(a * float(r[0]) + b * float(r[1]) for layer in layers for r in layer.records) / n)
        losses.append(total)
        if grads0 is None:
            grads0 = {
                k: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for k, p in params.items()
            }
        set_lr(opt, lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio))
        clip_grad_norm_(list(params.values()), c.grad_clip)
        opt.step()
    return losses, auxes, grads0, {k: p.detach().clone() for k, p in params.items()}


@pytest.mark.slow
def test_moe_training_equals_single_process(tmp_path):
    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, 256, 20_000), vocab_size=256)
    runs = [prepare(c) for c in _cases(str(data), str(tmp_path / "run"))]
    references = {}
    failures = []
    for run, gathered in zip(runs, fork_launch(_worker, 4, (runs,), timeout_s=600)[0], strict=True):
        c = run.config
        label = f"{c.model} {c.schedule} pp={c.pp} dp={c.dp} tp={c.tp} ep={c.ep} cp={c.cp}"
        key = (c.model, c.global_batch)
        if key not in references:
            references[key] = _reference(c, run.spec)
        ref_losses, ref_aux, ref_grads, ref_params = references[key]
        assert ref_aux[0] > 0.05, "the auxiliary losses must weigh in the check"
        paired = PAIRED.get(c.schedule, ()) if max(c.ep, c.cp) > 1 and c.tp == 1 else ()
        observed = []
        for losses, aux, grads, params, (overlapped, pp_rank, syncs) in gathered:
            # with dp > 1 the dp reductions average over dp × cp too: no second all-reduce over cp
            assert syncs == (STEPS if c.cp > 1 and c.dp == 1 else 0), (label, syncs)
            # the marked pairs ran on two threads under ep or cp (every step), nothing else did
            want = pp_rank in paired
            assert (overlapped >= STEPS) if want else (overlapped == 0), (label, pp_rank, overlapped)
            if not np.allclose(aux, ref_aux, rtol=RTOL, atol=0):
                failures.append(f"{label}: auxiliary losses {aux} != {ref_aux}")
            # every held parameter's gradient is compared (zero where the rank computed none)
            every = {name: grads.get(name, torch.zeros_like(p)) for name, p in params.items()}
            observed.append(Observed(losses, [], every, params, None))
        reference = Reference(ref_losses, ref_grads, [], None, ref_params)
        found, held = compare(label, observed, reference, RTOL)
        failures += found
        # every parameter somewhere; an expert on dp/ep ranks, every other parameter on all dp ranks
        assert set(held) == set(ref_params), label
        for name, count in held.items():
            assert count == (c.dp // c.ep if ".experts." in name else c.dp) * c.tp * c.cp, (label, name)
    assert not failures, "\n".join(failures[:20])
