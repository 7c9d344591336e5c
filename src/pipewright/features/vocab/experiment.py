"""The paper's 1F1B setting simulated for every method (pure Python): MFU and peak memory per vocabulary.

Yeung et al. 2024 (§6): a ≈4B GPT — 32 layers, hidden 3072, 24 heads, FFN 12288 — sequence 2048 or 4096,
microbatch 1, 128 microbatches, pp = 8 on 8 A100-80GB (one NVLink node), V = 32k…256k. MFU is their
convention: model FLOPs without recomputation, 3·(2·b·s·h·V + l·(8·b·s·h² + 4·b·s²·h + 4·b·s·h·F)) per
microbatch, over 312 TFLOP/s per device.

Methods: ``naive`` (the naive placement: embedding on the first stage, output on the last),
``redistribute`` (fewer layers on the first and last stages, :func:`~.cost.redistribute_layout`),
``vp-naive``, ``alg1`` and ``alg2`` (vocabulary parallelism with the naive three-barrier algorithm,
Algorithm 1 or Algorithm 2, inserted by :func:`~.insert.insert_vocab`, placed by the same cost model).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.features.vocab.cost import (
    VocabComm,
    naive_cost,
    redistribute_cost,
    vocab_cost,
)
from pipewright.features.vocab.insert import insert_vocab
from pipewright.features.vocab.simulate import placement_costs
from pipewright.models.spec import ModelSpec
from pipewright.schedules.registry import build_schedule
from pipewright.sim.engine import simulate

METHODS = ("naive", "redistribute", "vp-naive", "alg1", "alg2")
#: method → vocabulary-parallel algorithm (``naive`` is the placement, ``vp-naive`` the algorithm)
ALGORITHM = {"vp-naive": "naive", "alg1": "alg1", "alg2": "alg2"}
PEAK = 312e12  # A100 bf16 dense, the paper's MFU denominator
VOCABS = (32 * 1024, 64 * 1024, 128 * 1024, 256 * 1024)


def paper_model(vocab: int, seq_len: int) -> ModelSpec:
    return ModelSpec("vocab-paper-4b", 32, 3072, 24, vocab, seq_len, ffn_hidden=12288)


def paper_model_flops(spec: ModelSpec, microbatches: int, b: int = 1) -> float:
    """The artifact's model FLOPs of one iteration (no recomputation)."""
    s, h, V, l, f = spec.seq_len, spec.hidden, spec.vocab, spec.layers, spec.ffn_hidden
    per = 3 * (2 * b * s * h * V + l * (8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * f))
    return per * microbatches


@dataclass(frozen=True)
class Row:
    schedule: str
    method: str
    seq_len: int
    vocab: int
    iteration_s: float
    mfu: float
    peak_memory_gib: float
    min_memory_gib: float
    layout: str = ""


def run(
    method: str,
    spec: ModelSpec,
    schedule_name: str = "1f1b",
    pp: int = 8,
    microbatches: int = 128,
    virtual: int | None = None,
    iterations: int = 2,
    attention: str = "flash",
    extra: int | None = None,
) -> Row:
    """Simulate one method; MFU from the artifact's model FLOPs over the simulated iteration time.
    ``attention``: the transformer layers' (TransformerCost); the paper's runs use flash attention
    (the artifact's ``pretrain_gpt.sh`` passes ``--use-flash-attn``). ``extra``: the insertion pass's
    memory allowance (:func:`~.insert.insert_vocab`; default the algorithm's)."""
    base = build_schedule(schedule_name, pp, microbatches, virtual)
    layout = ""
    if method == "naive":
        cost, comm, sched = naive_cost(spec, pp=pp, attention=attention), None, base
    elif method == "redistribute":
        cost = redistribute_cost(spec, base, pp=pp, attention=attention)
        layout = ",".join(map(str, cost.layout))
        comm, sched = None, base
    else:
        algorithm = ALGORITHM[method]
        cost = vocab_cost(spec, pp=pp, algorithm=algorithm, attention=attention)
        comm = VocabComm(cost)
        sched = insert_vocab(base, algorithm, placement_costs(cost, base), extra)
    result = simulate(sched, cost, comm=comm if comm is not None else cost.comm, iterations=iterations)
    t = result.iteration_time
    mfu = paper_model_flops(spec, microbatches) / (t * pp * PEAK)
    return Row(
        schedule_name,
        method,
        spec.seq_len,
        spec.vocab,
        t,
        mfu,
        max(result.peak_memory) / 2**30,
        min(result.peak_memory) / 2**30,
        layout,
    )


def table(
    schedule_name: str = "1f1b",
    seqs=(2048, 4096),
    vocabs=VOCABS,
    microbatches: int = 128,
    attention: str = "flash",
) -> list[Row]:
    return [
        run(method, paper_model(vocab, seq), schedule_name, microbatches=microbatches, attention=attention)
        for seq in seqs
        for vocab in vocabs
        for method in METHODS
    ]
