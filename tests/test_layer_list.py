"""Any model as a list of layers (``pipewright.pipeline``) trains through every synchronous schedule
and equals one process.

The model: an 8-layer MLP stack with a module tied between positions 2 and 5 (its copies live on two
pipeline ranks, or on one rank in two stages under the V placements) and a classification head. Every
synchronous schedule once, at its largest v, the layouts alternating between (pp, dp) = (4, 1) and
(2, 2), 1F1B on an uneven layout string and ZB-H1 (split backward) partitioned by parameters: the loss
and every gradient of the first step, the gradient norm of every step, every parameter after 3 steps
(SGD with momentum, warm-up, clipping active) and the validation loss then match the whole list
trained in one process within 1e-5 relative (fp32). One 4-process launch runs every case.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import pipewright
from _queue_spawn import fork_launch
from _single_process import Reference, compare, train_and_gather, train_one_process
from pipewright.errors import ConfigError, PipewrightError
from pipewright.models.layer_list import LayerList, balanced_counts
from pipewright.runtime.setup.config import TrainConfig
from pipewright.schedules import schedule_names
from pipewright.schedules.registry import check_args, info

STEPS = 3
RTOL = 1e-5
IN, HIDDEN, CLASSES = 6, 16, 4


def _first() -> nn.Module:
    return nn.Linear(IN, HIDDEN)


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())


def _mixer() -> nn.Module:
    return nn.Linear(HIDDEN, HIDDEN, bias=False)


def _mix(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + torch.tanh(module(x))


def _head() -> nn.Module:
    return nn.Linear(HIDDEN, CLASSES)


def _data(split: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed({"train": 1000, "val": 5000}[split] + step)
    return torch.randn(rows, IN, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def _layers() -> list:
    mix = pipewright.Tied("mix", _mixer, _mix)
    return [_first, _block, mix, _block, _block, mix, _block, _head]


def _pipe(partition="uniform") -> pipewright.training.layer_pipeline.LayerPipeline:
    return pipewright.pipeline(_layers(), nn.functional.cross_entropy, data=_data, partition=partition)


def _base() -> TrainConfig:
    return TrainConfig(
        microbatch_size=2, steps=STEPS, lr=0.05, warmup=2, grad_clip=0.5, optimizer="sgd", progress=False,
        artifacts=False, eval_every=0, eval_batches=1, recv_timeout_s=120,
    )  # fmt: skip


def _accepts(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_args(name, p, m, v)
    except PipewrightError:
        return False
    return True


def _cases() -> list[tuple[str, TrainConfig]]:
    """(partition, config): each synchronous schedule once, at its largest v, the layouts alternating
    between (pp, dp) = (4, 1) and (2, 2); 1F1B with an uneven layout string, ZB-H1 split by parameters."""
    out = []
    names = [n for n in schedule_names(distinct_orders=True) if info(n).synchronous]
    for i, name in enumerate(names):
        pp, dp = ((4, 1), (2, 2))[i % 2]
        v = max(info(name).chunks or (1, 2))
        m = next(m for m in (4, 8) if _accepts(name, pp, m, v))
        part = {"1f1b": "t*3|t*5", "zb-h1": "parameters"}.get(name, "uniform")
        out.append((part, replace(_base(), schedule=name, pp=pp, dp=dp, virtual=v, microbatches=m)))
    return out


def _reference(model: LayerList, c: TrainConfig) -> Reference:
    """The whole list in one process on the whole global batch (one validation batch after)."""
    return train_one_process(
        c,
        model.full(seed=c.seed),
        lambda split, i: _data(split, i, c.global_batch),
        nn.functional.cross_entropy,
        1,
    )


@pytest.mark.slow
def test_layer_list_equals_one_process_in_every_schedule(tmp_path):
    runs = [_pipe(part).prepare(replace(c, out=str(tmp_path / "run"))) for part, c in _cases()]
    assert len(runs) >= 12 and {(r.config.pp, r.config.dp) for r in runs} == {(4, 1), (2, 2)}
    holders = [r.model.tied_stages(r.layout)["mix"] for r in runs]
    assert any(
        len(set(map(r.schedule.rank_of, h))) < len(h) for r, h in zip(runs, holders, strict=True)
    )  # one rank, 2 stages
    assert {r.layout.layer_counts for r in runs} >= {(3, 5), (2, 2, 2, 2)}
    references: dict[int, Reference] = {}
    failures = []
    for run, gathered in zip(runs, fork_launch(train_and_gather, 4, (runs,), timeout_s=600)[0], strict=True):
        c = run.config
        label = f"{c.schedule} pp={c.pp} dp={c.dp} v={run.schedule.num_stages // c.pp} {run.layout}"
        if c.global_batch not in references:
            references[c.global_batch] = _reference(run.model, c)
        bad, seen = compare(label, gathered, references[c.global_batch], RTOL, norms=True)
        failures += bad
        assert set(seen) == set(references[c.global_batch].grads0), label
    assert not failures, "\n".join(failures[:20])


def test_partitions():
    """uniform, by parameters (exact min-max), layout strings with or without E/L, counts, costs."""
    model = LayerList(_layers(), nn.functional.cross_entropy, _data, "parameters")
    params = model.parameter_counts()
    assert params[5] == 0 and params[2] == HIDDEN * HIDDEN  # a tied module counted once
    assert model.stage_counts(4) == balanced_counts(params, 4)
    assert balanced_counts([1, 1, 1, 9, 1, 1], 3) == (3, 1, 2)
    assert balanced_counts([5, 1, 1, 1], 2) == (1, 3)
    for part, want in (("uniform", (3, 3, 2)), ("Et*2|t*4|t*2L", (2, 4, 2)), ([1, 1, 6], (1, 1, 6))):
        assert LayerList(_layers(), nn.functional.cross_entropy, _data, part).stage_counts(3) == want
    costs = [1.0] * 7 + [10.0]
    assert LayerList(_layers(), nn.functional.cross_entropy, _data, costs).stage_counts(2) == (7, 1)


def test_partition_from_a_profile_table(tmp_path):
    table = tmp_path / "profile.csv"
    rows = "".join(f"{i},2,F,{1.0 if i < 7 else 5.0},\n{i},2,B,{2.0 if i < 7 else 10.0},\n" for i in range(8))
    table.write_text("layer_type,microbatch_size,kind,seconds,bytes\n" + rows)
    assert LayerList(_layers(), nn.functional.cross_entropy, _data, str(table)).stage_counts(2) == (
        6,
        2,
    )  # 18 | 3 + 15


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="holds 7 layers but the list has 8"):
        LayerList(_layers(), nn.functional.cross_entropy, _data, "t*3|t*4").stage_counts(2)
    with pytest.raises(ConfigError, match=r"9 pipeline stages \(pp × virtual\) but only 8 layers"):
        LayerList(_layers(), nn.functional.cross_entropy, _data).stage_counts(9)
    with pytest.raises(ConfigError, match="--tp does not apply to a layer-list model"):
        _pipe().prepare(replace(_base(), tp=2, pp=2))
    with pytest.raises(ConfigError, match="layer list is empty"):
        pipewright.pipeline([], nn.functional.cross_entropy, data=_data)
    with pytest.raises(ConfigError, match=r"neither an nn\.Module nor a factory"):
        LayerList([3], nn.functional.cross_entropy, _data).full()


def test_each_option_a_layer_list_refuses_reads_its_own_field():
    from pipewright.runtime.setup.config import TrainConfig
    from pipewright.training.layer_pipeline import _unsupported

    assert not any(given for given, _ in _unsupported(TrainConfig()).values())
    changed = {"--tp": {"tp": 2}, "--init-from": {"init_from": "/x"},
               "--tie-embeddings": {"tie_embeddings": True},
               "--sequence-parallel": {"sequence_parallel": True},
               "--scatter-gather": {"scatter_gather": True},
               "--cp": {"cp": 2}, "--ep": {"ep": 2}}  # fmt: skip
    assert set(changed) == set(_unsupported(TrainConfig()))
    for flag, values in changed.items():
        given = [f for f, (set_, _) in _unsupported(replace(TrainConfig(), **values)).items() if set_]
        assert given == [flag]
