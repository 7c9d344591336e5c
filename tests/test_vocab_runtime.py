"""Vocabulary parallelism in the pipeline executor against the single-process model (fp32, 1e-5).

The test matrix, p ∈ {2, 4} × t ∈ {1, 2} × {1F1B, interleaved 1F1B, V-Half} × {naive, alg1,
alg2} (36 cases), in one launch of 8 workers sharing one process group: p = 4 × t = 2 is one pipeline of
8 vocabulary shards; the smaller pipelines run as 8 / (p·t) data-parallel replicas, each with its own
vocabulary group. Each case compares the per-microbatch losses, every transformer parameter's gradient
(tensor-parallel shards gathered) and both vocabulary shards' gradients with the unpartitioned model.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist

from _queue_spawn import spawn_cases
from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.runtime import VocabRuntime, VocabStage, full_name, vocab_group
from pipewright.models.gpt import build_full, build_stage, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.runtime.core.executor import PipelineExecutor
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import full_parameters, tp_linear_factory
from pipewright.schedules.registry import build_schedule

RTOL = 1e-5
SPEC = ModelSpec("tiny", layers=8, hidden=16, heads=2, vocab=38, seq_len=6)  # padded to 40
B, M, SEED = 2, 4, 3
SCHEDULES = [("1f1b", None), ("interleaved-1f1b", 2), ("v-half", None)]
ALGORITHMS = ("naive", "alg1", "alg2")
PIPELINES = ((2, 1), (4, 1), (2, 2), (4, 2))  # (p, t); the world has 8 ranks (dp = 8 / (p·t))
WORLD = 8


def _data():
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, SPEC.vocab, (B, SPEC.seq_len), generator=g) for _ in range(M)]
    targets = [torch.randint(0, SPEC.vocab, (B, SPEC.seq_len), generator=g) for _ in range(M)]
    return ids, targets


@functools.cache
def _reference():
    torch.manual_seed(0)
    model = build_full(SPEC, SEED)
    ids, targets = _data()
    losses = []
    for k in range(M):
        loss = loss_fn(model(ids[k]), targets[k])
        (loss / M).backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _err(label, actual, expected) -> str:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1e-12)
    return "" if err <= RTOL * scale else f"{label}: max error {err:.3g} over scale {scale:.3g}"


def _schedules() -> dict:
    """Every case's schedule (naive: S in two passes around its MAX all-reduce), computed on rank 0 and
    broadcast."""
    box = [None]
    if dist.get_rank() == 0:
        box[0] = {
            (name, p, alg): insert_vocab(build_schedule(name, p, M, v), alg)
            for p in sorted({p for p, _ in PIPELINES})
            for name, v in SCHEDULES
            for alg in ALGORITHMS
        }
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _case(mesh, group, sched, algorithm) -> str:
    mine = sched.stages_of(mesh.pp_rank)
    factory = tp_linear_factory(mesh.group("tp")) if mesh.tp > 1 else None
    n = sched.num_stages
    stages = {
        s: VocabStage(build_stage(SPEC, None, s, seed=SEED, num_stages=n, linear_factory=factory))
        for s in mine
    }
    rt = VocabRuntime(
        SPEC, group, algorithm=algorithm, seed=SEED, microbatch_shape=(B, SPEC.seq_len),
        last_rank=sched.rank_of(sched.num_stages - 1),
    )  # fmt: skip
    ex = PipelineExecutor(
        sched, mesh, stages, loss_fn=None, boundary_shape=(B, SPEC.seq_len, SPEC.hidden),
        handlers=rt.handlers(),
    )  # fmt: skip
    ids, targets = _data()
    losses = ex.run(ids, targets)
    rt.finish()
    ref_losses, ref_grads = _reference()
    errors = []
    if sched.num_stages - 1 in mine:
        errors.append(_err("losses", torch.tensor(losses), torch.tensor(ref_losses)))
    for s, module in stages.items():
        for n, grad in full_parameters(module, grad=True).items():
            errors.append(_err(f"stage {s} {n}", grad, ref_grads[full_name(n)]))
    start, end, _ = vs.shard_range(SPEC.vocab, group.shards, group.index)
    for label, prm, full in (
        ("embedding shard", rt.embedding.weight, ref_grads["embed.tok.weight"]),
        ("output shard", rt.output.weight, ref_grads["head.out.weight"]),
    ):
        padded = torch.cat(
            [full, full.new_zeros(vs.padded_vocab(SPEC.vocab, group.shards) - SPEC.vocab, SPEC.hidden)]
        )
        errors.append(_err(label, prm.grad, padded[start:end]))
    return "; ".join(e for e in errors if e)


def _cases(rank: int, world: int) -> dict[str, str]:
    results: dict[str, str] = {}
    schedules = _schedules()
    for p, t in PIPELINES:
        mesh = ParallelMesh.build(dp=world // (p * t), pp=p, tp=t, device="cpu")
        group = vocab_group(mesh)
        for name, _ in SCHEDULES:
            for algorithm in ALGORITHMS:
                key = f"p={p} t={t} {name} {algorithm}"
                try:
                    sched = schedules[name, p, algorithm]
                    results[key] = _case(mesh, group, sched, algorithm)
                except Exception:
                    results[key] = traceback.format_exc()
                dist.barrier()
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, list[str]]:
    return spawn_cases(_cases, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize(("p", "t"), PIPELINES)
@pytest.mark.parametrize(("name", "v"), SCHEDULES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_runtime_equals_unpartitioned_model(results, p, t, name, v, algorithm) -> None:
    got = results[f"p={p} t={t} {name} {algorithm}"]
    assert len(got) == WORLD
    bad = [e for e in got if e]
    assert not bad, "\n".join(bad)
