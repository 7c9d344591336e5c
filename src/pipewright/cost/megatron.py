"""Megatron-LM Table 1 (Narayanan et al., SC21): the published weak-scaling runs, and Megatron's
closed-form iteration time on our costs.

Each row runs on Selene (DGX A100 80GB: 8 GPUs on NVSwitch, 8 × HDR InfiniBand per node), fp16, full
recomputation, sequence 2048, vocabulary 51200, Megatron's tp-dp-pp rank order, the 1F1B schedule
(interleaved with v chunks per rank where v > 1). The prediction of each row (simulated, or with
:func:`closed_form_iteration_time`) is :mod:`pipewright.plan.table1`: it builds the row's setup with
:func:`pipewright.plan.setup.model_setup`, the path ``pipewright simulate --model`` takes.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from pipewright.cost.base import CommModel, CostModel
from pipewright.cost.sharding import reduction_parts
from pipewright.errors import PipewrightError
from pipewright.ir import REDUCE_GRAD, Action, B, F, Schedule
from pipewright.models.presets import MEGATRON_SEQ, MEGATRON_VOCAB
from pipewright.models.spec import ModelSpec

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Table1Row:
    """One row of Megatron-LM Table 1 (columns of ``reference/megatron_table1.csv``)."""

    params_billion: float
    attention_heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    global_batch: int
    microbatch: int
    virtual_chunks: int
    tflops_per_gpu: float
    percent_of_peak: float
    aggregate_pflops: float

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline: global batch / (microbatch size × dp)."""
        return self.global_batch // (self.microbatch * self.dp)

    @property
    def name(self) -> str:
        p = self.params_billion
        return "megatron-1t" if p >= 1000 else f"megatron-{p:g}b"

    def spec(self) -> ModelSpec:
        return ModelSpec(
            self.name, self.layers, self.hidden, self.attention_heads, MEGATRON_VOCAB, MEGATRON_SEQ
        )


_ROWS = (
    (1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 16, 1, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 32, 64, 512, 16, 1, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 32, 128, 512, 16, 1, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 32, 256, 1024, 8, 1, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 32, 512, 1536, 4, 1, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 32, 1024, 1792, 2, 3, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 24, 1536, 2304, 2, 2, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 15, 1920, 2160, 1, 2, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 9, 2520, 2520, 1, 3, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 6, 3072, 3072, 1, 1, 163, 52, 502.0),
)

#: The ten published rows (the same numbers as the package's ``data/megatron_table1.csv``).
TABLE1: tuple[Table1Row, ...] = tuple(Table1Row(*r) for r in _ROWS)


def packaged_table1() -> tuple[Table1Row, ...]:
    """Table 1 as shipped with the package (``cost/data/megatron_table1.csv``, the published rows with
    their source notes)."""
    return load_table1(str(resources.files("pipewright.cost").joinpath("data/megatron_table1.csv")))


def load_table1(path: str | Path) -> tuple[Table1Row, ...]:
    """Read Table 1 from a CSV with the columns of :class:`Table1Row` (``#`` lines are comments)."""
    try:
        lines = [x for x in Path(path).read_text().splitlines() if x and not x.startswith("#")]
    except OSError as exc:
        raise PipewrightError(f"cannot read {path}: {exc.strerror}") from None
    rows = []
    for item in csv.DictReader(lines):
        values = []
        for f in fields(Table1Row):
            cast = float if f.type == "float" else int
            values.append(cast(item[f.name]))
        rows.append(Table1Row(*values))
    return tuple(rows)


def closed_form_iteration_time(schedule: Schedule, cost: CostModel, comm: CommModel) -> float:
    """Megatron's iteration time, stage costs taken from ``cost`` and ``comm``:

    T = m · max_r T_r + (p − 1)/v · mean_r T_r + max_r Σ_{c on r} reduce_dp(grads of c),

    T_r = Σ over rank r's chunks of (F + B + a forward and a backward message to the next/previous
    rank). For equal stages the first two terms are (m + (p − 1)/v)·(t_F + t_B) (the 1F1B/interleaved
    bubble); gradients are reduced after the pipeline drains (not overlapped). reduce_dp is the
    REDUCE_GRAD's collectives over the data-parallel group, one after the other: an all-reduce, or with
    the distributed optimizer a reduce-scatter of the gradient buffer and an all-gather of the
    parameters (:func:`pipewright.cost.sharding.reduction_calls`), each priced as its own call."""
    p, v, m, n = schedule.num_ranks, schedule.chunks_per_rank, schedule.num_microbatches, schedule.num_stages
    per_rank = []
    for r in range(p):
        total = 0.0
        for c in schedule.stages_of(r):
            total += cost.compute_time(Action(c, F, 0), schedule) + cost.compute_time(
                Action(c, B, 0), schedule
            )
            if c + 1 < n and not schedule.local(c, c + 1):
                nbytes = cost.message_bytes(Action(c, "SEND_F", 0), schedule)
                dst = schedule.rank_of(c + 1)
                total += comm.p2p_time(r, dst, nbytes) + comm.p2p_time(dst, r, nbytes)
        per_rank.append(total)
    pipeline = m * max(per_rank) + (p - 1) / v * sum(per_rank) / p
    reduce = max(sum(reduce_dp(cost, comm, schedule, c) for c in schedule.stages_of(r)) for r in range(p))
    return pipeline + reduce


def reduce_dp(cost: CostModel, comm: CommModel, schedule: Schedule, stage: int) -> float:
    """Seconds of stage ``stage``'s data-parallel gradient reduction: Σ over its calls
    (:func:`~pipewright.cost.sharding.reduction_parts`: an all-reduce, or a sharded optimizer's
    reduce-scatter and all-gather) of each call's collective time over the rank's dp group."""
    nbytes = cost.message_bytes(Action(stage, REDUCE_GRAD), schedule)
    rank = schedule.rank_of(stage)
    return sum(comm.collective_time(k, rank, b) for k, b in reduction_parts("all_reduce", nbytes))
