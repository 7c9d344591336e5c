"""Hugging Face decoders (``--hf-model``) trained through the pipeline equal the ``transformers`` model
trained in one process.

For every family of ``_hf_families.py`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, OLMo,
OLMo 2, GPT-2, GPT-NeoX; tiny, random, fp32, eager attention; Gemma and GPT-2 with tied embeddings):
layouts out of 1F1B at pp = 2 and pp = 4, interleaved 1F1B (pp = 2, v = 2), ZB-H1 (pp = 4, split I/W
backward) and ZB-V (pp = 2, v = 2), spread so that every layout meets four or more families and the
tied families all five (:data:`SPREAD`; ``PIPEWRIGHT_FULL_HF=1`` runs every family in every layout),
and 1F1B at pp = 2 × tp = 2 for Llama, Qwen3 and Gemma 3 (all seven families with Llama-style
projections in the full run): the loss of each of 3 SGD steps (warm-up, clipping active), every
gradient of the first step and every parameter after the third equal the single-process
``transformers`` model's within 1e-5 relative. One launch of 4 gloo processes runs every case
(pp = 2 layouts with dp = 2).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from _hf_families import FAMILIES, VOCAB, write_family
from _queue_spawn import fork_launch
from _single_process import Reference, compare, dataset_batches, train_and_gather, train_one_process
from pipewright.data.tokens import write_tokens
from pipewright.errors import ConfigError
from pipewright.models.gpt import loss_fn
from pipewright.runtime.core.trainer import PreparedRun
from pipewright.runtime.setup.config import TrainConfig
from pipewright.training import prepare

pytest.importorskip("transformers")

RTOL = 1e-5
STEPS = 3
#: (schedule, pp, dp, tp, virtual, microbatches): a global batch of 8 sequences in each
LAYOUTS = (
    ("1f1b", 2, 2, 1, 1, 4),
    ("1f1b", 4, 1, 1, 1, 8),
    ("interleaved-1f1b", 2, 2, 1, 2, 4),
    ("zb-h1", 4, 1, 1, 1, 8),
    ("zbv", 2, 2, 1, 2, 4),
)
TP_LAYOUT = ("1f1b", 2, 1, 2, 1, 8)
#: the layouts (indices into LAYOUTS) each family runs: every layout meets four or more families, the
#: tied ones (Gemma 2, Gemma 3, GPT-2) together meet all five; PIPEWRIGHT_FULL_HF=1 runs every pair
SPREAD = {
    "llama": (0, 2),
    "mistral": (1, 3),
    "qwen2": (2, 4),
    "qwen3": (3, 0),
    "gemma2": (4, 1, 2),
    "gemma3": (0, 3),
    "phi3": (1, 3),
    "olmo": (2, 4),
    "olmo2": (3, 0),
    "gpt2": (4, 1, 3),
    "gpt_neox": (0, 2),
}
#: families run at pp = 2 × tp = 2 (Llama-style projections; Gemma 3 with its tied, scaled embedding)
TP_FAMILIES = ("llama", "qwen3", "gemma3")
FULL = os.environ.get("PIPEWRIGHT_FULL_HF") == "1"


def _config(folder, data: str) -> TrainConfig:
    return TrainConfig(
        hf_model=str(folder), seq_len=8, microbatch_size=1, steps=STEPS, lr=0.05, warmup=1, grad_clip=0.5,
        optimizer="sgd", data=data, progress=False, artifacts=False, eval_every=0, recv_timeout_s=120,
    )  # fmt: skip


def _cases(tmp_path, data: str) -> list[tuple[str, TrainConfig]]:
    out = []
    for family in FAMILIES:
        base = _config(write_family(tmp_path / "models", family), data)
        chosen = [LAYOUTS[i] for i in (range(len(LAYOUTS)) if FULL else SPREAD[family])]
        tp = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo") if FULL else TP_FAMILIES
        for schedule, pp, dp, t, v, m in chosen + ([TP_LAYOUT] if family in tp else []):
            config = replace(base, schedule=schedule, pp=pp, dp=dp, tp=t, virtual=v, microbatches=m)
            out.append((family, replace(config, out=str(tmp_path / "run"))))
    return out


def test_spread_covers_every_layout_and_family():
    assert set(SPREAD) == set(FAMILIES)
    for i in range(len(LAYOUTS)):
        assert sum(i in chosen for chosen in SPREAD.values()) >= 4
    assert set().union(*(SPREAD[f] for f in ("gemma2", "gemma3", "gpt2"))) == set(range(len(LAYOUTS)))


def _reference(run: PreparedRun) -> Reference:
    """The ``transformers`` model in one process on the whole global batch (names as the model's own)."""
    from transformers import AutoModelForCausalLM

    from pipewright.models.hf import load_config

    c = run.config
    torch.manual_seed(c.seed)
    model = AutoModelForCausalLM.from_config(load_config(c.hf_model), dtype=torch.float32).train()
    return train_one_process(
        c, model, dataset_batches(c, run.spec.seq_len), lambda out, y: loss_fn(out.logits, y)
    )


@pytest.mark.slow
def test_hf_families_pipelined_equal_transformers(tmp_path):
    from pipewright.models.hf import hf_parameter_name
    from pipewright.models.hf.adapters import adapter_for

    data = tmp_path / "tokens.bin"
    write_tokens(data, np.random.default_rng(0).integers(0, VOCAB, 4_000), vocab_size=VOCAB)
    cases = _cases(tmp_path, str(data))
    runs = [prepare(config) for _, config in cases]
    failures, references = [], {}
    for (family, _), run, gathered in zip(
        cases, runs, fork_launch(train_and_gather, 4, (runs, None, False), timeout_s=600)[0], strict=True
    ):
        c = run.config
        label = f"{family} {c.schedule} pp={c.pp} dp={c.dp} tp={c.tp}"
        assert c.global_batch == 8, label
        if family not in references:
            references[family] = _reference(run)
        paths = adapter_for(FAMILIES[family]["model_type"]).paths()

        def theirs(name: str, run: PreparedRun = run, paths=paths) -> str:
            if run.spec.tied_embeddings and name.startswith("head.out."):
                name = name.replace("head.out.", "embed.tok.")
            return hf_parameter_name(name, paths)

        bad, seen = compare(label, gathered, references[family], RTOL, rename=theirs)
        failures += bad
        assert set(seen) == set(references[family].grads0), label  # every parameter held somewhere
    assert not failures, "\n".join(failures[:20])


def test_hf_bad_input_one_line_errors(tmp_path):
    """A family that cannot be cut names the missing module; a layout whose layer count does not fit
    the config's; a family whose projections cannot be split for tensor parallelism names the fused
    module; a token file larger than the model's vocabulary names the data-preparation command."""
    from torch import nn

    from pipewright.models.family import build_stage
    from pipewright.models.hf import read_spec
    from pipewright.models.hf.adapters import modules

    errors = []
    spec = read_spec(write_family(tmp_path, "llama"), seq_len=8)
    with pytest.raises(ConfigError, match="layer") as err:
        build_stage(spec, "Et*3|t*2L", 0)
    errors.append(err)
    base = nn.Module()
    base.model = nn.Module()
    base.model.embed_tokens, base.model.layers = nn.Embedding(4, 2), nn.ModuleList()
    with pytest.raises(
        ConfigError, match=r"'llama' cannot be cut .* no final norm module 'model\.norm'"
    ) as err:
        modules(base, "llama")
    errors.append(err)

    def other_factory(i: int, o: int, *, bias: bool, kind: str) -> nn.Module:
        return nn.Linear(i, o, bias=bias)  # neither plain nor deferrable: the tensor-parallel path

    gpt2 = read_spec(write_family(tmp_path, "gpt2"), seq_len=8)
    with pytest.raises(ConfigError, match=r"'gpt2' cannot be split \(attn\.c_attn is a fused") as err:
        build_stage(gpt2, None, 0, num_stages=2, linear_factory=other_factory)
    errors.append(err)
    data = tmp_path / "big.bin"
    write_tokens(data, np.arange(200), vocab_size=200)
    config = _config(tmp_path / "llama", str(data))
    with pytest.raises(ConfigError, match="data prepare --tokenizer") as err:
        config.model_spec(dataset_vocab=200)
    errors.append(err)
    with pytest.raises(ConfigError, match="drop --layers") as err:
        replace(config, layers=2).check()
    errors.append(err)
    with pytest.raises(ConfigError, match=r"'phi3' cannot be split \(self_attn\.qkv_proj") as err:
        replace(config, hf_model=str(write_family(tmp_path, "phi3")), tp=2).check()
    errors.append(err)
    assert all("\n" not in str(e.value) for e in errors)
