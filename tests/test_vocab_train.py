"""``pipewright train --vocab-parallel`` end to end against single-process training (fp32, 1e-5 relative).

- the command line at pp = 2 with the TOML key ``vocab_parallel = "alg2"``: every step's loss and
  gradient norm, and the validation loss after step 3, equal the reference's;
- one launch of 4 forked workers through :class:`~pipewright.runtime.core.trainer.Trainer`: pp = 2 × dp = 2
  and
  pp = 2 × tp = 2, each algorithm and each of 1F1B, interleaved 1F1B and V-Half at least once (the full
  matrix runs in the executor, tests/test_vocab_runtime.py): 3 steps of losses,
  then every transformer parameter and both vocabulary shards equal the reference's; the first case
  saves a checkpoint after 2 steps and a new Trainer resumes from it for the third (the shards and
  their momentum go through the checkpoint);
- one-line errors for the combinations the runtime does not support.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _queue_spawn import fork_launch, forked_cli_launches
from _single_process import single_process
from pipewright.cli import main
from pipewright.data.tokens import write_tokens
from pipewright.errors import ConfigError
from pipewright.features.vocab import shard as vs
from pipewright.runtime.core.trainer import PreparedRun, Trainer
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.parallel.tp import full_parameters
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import prepare, replaced

RTOL = 1e-5
STEPS = 3
MODEL = ["--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "250", "--seq-len", "16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vocab_train") / "tokens.bin"
    write_tokens(path, np.random.default_rng(0).integers(0, 250, 20_000), vocab_size=250)
    return str(path)


def _base(data: str) -> TrainConfig:
    return TrainConfig(
        layers=4, hidden=32, heads=4, vocab=250, seq_len=16, microbatch_size=1, microbatches=4,
        steps=STEPS, lr=0.05, warmup=1, grad_clip=0.5, optimizer="sgd", data=data, progress=False,
        artifacts=False, eval_every=0, recv_timeout_s=120,
    )  # fmt: skip


def _reference(c: TrainConfig):
    """Single process: (losses, grad norms, val loss after the last step, parameters)."""
    ref = single_process(c, eval_batches=2)
    return ref.losses, ref.norms, ref.val, ref.params


def _close(got, want) -> bool:
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    return bool(np.abs(got - want).max() <= RTOL * np.abs(want).max())


@pytest.mark.slow
def test_cli_toml_equals_single_process(data, tmp_path):
    toml = tmp_path / "train.toml"
    toml.write_text('[train]\nvocab_parallel = "alg2"\n')
    out = tmp_path / "run"
    argv = [
        "train", "--config", str(toml), *MODEL, "--pp", "2", "--microbatches", "4", "--microbatch-size", "1",
        "--steps", str(STEPS), "--optimizer", "sgd", "--lr", "0.05", "--warmup", "1", "--data", data,
        "--eval-every", "3", "--no-progress", "--no-artifacts", "--out", str(out),
    ]  # fmt: skip
    with forked_cli_launches():
        assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_parallel"] == "alg2"
    ref_losses, ref_norms, ref_val, _ = _reference(replace(_base(data), grad_clip=1.0))
    assert _close([r["loss"] for r in records], ref_losses)
    assert _close([r["grad_norm"] for r in records], ref_norms)
    assert _close([records[-1]["val_loss"]], [ref_val])


# ------------------------------------------------------------------ pp = 2 × (dp = 2 | tp = 2), Trainer

CASES = (  # (dp, tp, schedule, virtual, algorithm): every schedule and algorithm, dp and tp, once
    (2, 1, "1f1b", None, "naive"),  # with the checkpoint and resume
    (2, 1, "v-half", None, "alg2"),
    (1, 2, "interleaved-1f1b", 2, "alg1"),
    (1, 2, "v-half", None, "naive"),
)


def _worker(rank: int, runs: list[PreparedRun]):
    torch.set_num_threads(1)
    meshes, results = {}, []
    for run in runs:
        c = run.config
        if (c.dp, c.tp) not in meshes:
            meshes[c.dp, c.tp] = ParallelMesh.build(dp=c.dp, pp=c.pp, tp=c.tp)
        trainer = Trainer(run, mesh=meshes[c.dp, c.tp])
        losses = []
        for step in range(c.steps):
            if step == 2 and run is runs[0]:  # save, then resume in a fresh trainer
                path = trainer.save(step)
                trainer = Trainer(replace(run, resume_from=path, start_step=step), mesh=meshes[c.dp, c.tp])
                assert trainer.load(path) == step
            losses.append(trainer.forward_backward(step))
            trainer.optimizer_step(step)
        params = {n: t.clone() for m in trainer.stages.values() for n, t in full_parameters(m).items()}
        shards = {n.split("#")[0]: p.detach().clone() for n, p in trainer.built.parameters.items()}
        shard = (trainer.mesh.pp_rank * c.tp + trainer.mesh.tp_rank, c.pp * c.tp)
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object((losses, params, shards, shard), gathered, dst=0)
        results.append(gathered)
    return results if rank == 0 else None


@pytest.mark.slow
def test_trainer_pp2_dp2_tp2_equals_single_process(data, tmp_path):
    from pipewright.features.vocab.runtime import full_name

    runs = [
        prepare(
            replaced(
                _base(data),
                dp=dp,
                tp=tp,
                pp=2,
                schedule=name,
                virtual=v,
                vocab_parallel=alg,
                out=str(tmp_path / f"run{i}"),
            )
        )
        for i, (dp, tp, name, v, alg) in enumerate(CASES)
    ]
    failures = []
    for run, gathered in zip(runs, fork_launch(_worker, 4, (runs,), timeout_s=600)[0], strict=True):
        c = run.config
        ref_losses, _, _, ref_params = _reference(c)
        label = f"dp={c.dp} tp={c.tp} {c.schedule} {c.features['vocab'].parallel}"
        for rank, (losses, params, shards, (q, n)) in enumerate(gathered):
            if not _close(losses, ref_losses):
                failures.append(f"{label} rank {rank}: losses {losses} vs {ref_losses}")
            for name, value in params.items():
                if not _close(value, ref_params[full_name(name)]):
                    failures.append(f"{label} rank {rank}: {name}")
            for name, value in shards.items():
                full = ref_params[name]
                padded = torch.cat([full, full.new_zeros(vs.padded_vocab(c.vocab, n) - c.vocab, c.hidden)])
                start, end, _ = vs.shard_range(c.vocab, n, q)
                if not _close(value, padded[start:end]):
                    failures.append(f"{label} rank {rank}: {name} shard {q}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"tie_embeddings": True}, "does not support tied embeddings"),
        ({"tp": 2, "sequence_parallel": True}, "does not support --sequence-parallel"),
        ({"precision": "bf16"}, "does not support --precision bf16"),
        ({"shard_optimizer": True, "dp": 2}, "does not support --shard-optimizer"),
        ({"model": "llama"}, "GPT family only"),
        ({"vocab_parallel": "redistribute"}, "is a layout"),
        ({"vocab_parallel": "alg3"}, "choose one of none, naive, alg1, alg2"),
    ],
)
def test_unsupported_combinations_are_one_line(data, tmp_path, extra, expected):
    config = replaced(_base(data), out=str(tmp_path / "run"), **{"pp": 2, "vocab_parallel": "alg1", **extra})
    with pytest.raises(ConfigError, match=expected) as info:
        prepare(config)
    assert "\n" not in str(info.value)


def test_cli_flag_sets_the_config(data, tmp_path, capsys):
    argv = ["train", *MODEL, "--pp", "2", "--data", data, "--vocab-parallel", "tied", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        main(argv)
    assert "invalid choice: 'tied'" in capsys.readouterr().err
    from pipewright.cli import build_parser
    from pipewright.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--vocab-parallel", "naive"])
    assert config_from_args(args).features["vocab"].parallel == "naive"
    assert config_from_args(build_parser().parse_args(["train"])).features["vocab"].parallel == "none"
