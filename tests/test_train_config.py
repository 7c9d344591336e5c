"""TrainConfig: TOML/flag merging and the model dimensions it resolves (no processes)."""

from __future__ import annotations

import pytest

from pipewright.errors import ConfigError
from pipewright.runtime.checkpointing.fingerprint import fingerprint
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import config_from_toml


def test_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\npp = 4\nmicrobatch-size = 2\nschedule = "gpipe"\n')
    config = config_from_toml(path).with_overrides(pp=2, dp=None, steps=7)
    assert (config.pp, config.microbatch_size, config.schedule, config.steps, config.dp) == (
        2,
        2,
        "gpipe",
        7,
        1,
    )
    assert config.global_batch == 2 * config.microbatches * config.dp


def test_dimensions_follow_flags():
    spec = TrainConfig(hidden=32, heads=4, layers=2).model_spec(dataset_vocab=256)
    assert (spec.hidden, spec.ffn_hidden, spec.vocab, spec.layers) == (32, 128, 256, 2)
    assert TrainConfig(hidden=32, heads=4, ffn_hidden=40).model_spec(256).ffn_hidden == 40
    with pytest.raises(ConfigError, match="smaller than the dataset"):
        TrainConfig(vocab=100).model_spec(dataset_vocab=256)
    with pytest.raises(ConfigError, match="unknown model"):
        TrainConfig(model="nope").model_spec(256)


def test_fingerprint_depends_on_dimensions_only():
    a = TrainConfig().model_spec(256)
    assert fingerprint(a, "byte") == fingerprint(TrainConfig(pp=4, lr=1.0).model_spec(256), "byte")
    assert fingerprint(a, "byte") != fingerprint(TrainConfig(hidden=64).model_spec(256), "byte")
    assert fingerprint(a, "byte") != fingerprint(a, "bpe:512")


def test_fingerprint_records_the_tensor_parallel_state_layout():
    """tp > 1 stores the vocabulary-parallel embedding as shards: another fingerprint (tp = 1 unchanged);
    sequence parallelism and scatter/gather change no state names: not recorded."""
    a = TrainConfig().model_spec(256)
    assert fingerprint(a, "byte", 1) == fingerprint(a, "byte")
    assert len({fingerprint(a, "byte", t) for t in (1, 2, 4)}) == 3
    sp = TrainConfig(tp=2, sequence_parallel=True)
    sp.check()
    assert fingerprint(sp.model_spec(256), "byte", sp.tp) == fingerprint(a, "byte", 2)


def test_sequence_parallel_and_scatter_gather_are_checked():
    with pytest.raises(ConfigError, match="drop one of"):
        TrainConfig(tp=2, sequence_parallel=True, scatter_gather=True).check()
    with pytest.raises(ConfigError, match="needs tensor parallelism"):
        TrainConfig(scatter_gather=True).check()
    with pytest.raises(ConfigError, match="--seq-len 30 is not divisible by --tp 4"):
        TrainConfig(tp=4, heads=8, hidden=64, seq_len=30, sequence_parallel=True).model_spec(256)
    assert TrainConfig(tp=4, heads=8, hidden=64, seq_len=30).model_spec(256).seq_len == 30


#: Model flags, and the vocabulary of the data ``train`` reads (the preset's where no --vocab is given).
SAME_MODEL = {
    "gpt preset, layers and hidden": ("--model gpt-tiny --layers 2 --hidden 32", 256),
    "llama preset, grouped heads": ("--model llama-tiny --layers 2 --hidden 64 --heads 8 --kv-heads 2", 256),
    "vocab over the data's": ("--model gpt-small-cpu --vocab 512", 256),
    "llama family": (
        "--model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
        "--vocab 300 --seq-len 32 --ffn-hidden 96",
        256,
    ),
    "mixture of experts": ("--model gpt-moe-tiny --moe-experts 8 --moe-top-k 1 --moe-ffn-hidden 24", 256),
}


@pytest.mark.parametrize("case", SAME_MODEL)
def test_train_builds_the_model_simulate_prices(monkeypatch, case):
    """The same model flags give ``train`` (the data's vocabulary where no --vocab is given) and
    ``simulate`` (each model its cost model is built for) one ModelSpec."""
    import pipewright.plan.setup as setup
    from pipewright.cli import build_parser, main
    from pipewright.cli.train import config_from_args

    flags, dataset_vocab = SAME_MODEL[case][0].split(), SAME_MODEL[case][1]
    priced, model_setup = [], setup.model_setup

    def priced_setup(model, *args, **kwargs):
        priced.append(model)
        return model_setup(model, *args, **kwargs)

    monkeypatch.setattr(setup, "model_setup", priced_setup)
    run = [
        "--gpu",
        "a100-80gb",
        "--gpus-per-node",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--schedule",
        "1f1b",
    ]
    assert main(["simulate", *flags, *run]) == 0
    trained = config_from_args(build_parser().parse_args(["train", *flags])).model_spec(dataset_vocab)
    assert priced and all(model == trained for model in priced)
