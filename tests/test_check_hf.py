"""``pipewright check --hf-model``: the pipelined run against ``transformers``' own model too.

In this process, for every family of ``_hf_families.py`` and the mixtures of experts (Mixtral,
Qwen2-MoE): pipewright's stage modules give ``transformers``' logits on the first batch (exactly, GPT-2
within 2e-7: its learned positions are added in another order) and the same loss by ``transformers``'
loss function. Granite and Cohere (no adapter; multipliers in the model's forward) are refused naming
the type; ``--moe-*``, ``--ep`` and ``--cp`` with ``--hf-model`` are one-line errors. The router loss of
Mixtral and Qwen2-MoE (``output_router_logits``) equals ``transformers``' on every schedule. Two
``check`` runs (forked workers): Mixtral at pp = 2 equals one process and ``transformers`` at every
step; GPT-2 with its dropout 0.1 (disabled for the comparison, and said so) and a deliberately broken
adapter (its learned positions left out) equals one process — both runs share the bug — and differs
from ``transformers`` at the first batch, named in the last line.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from _hf_families import FAMILIES, MOE_FAMILIES, UNADAPTED, VOCAB, write_config
from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.data.tokens import write_tokens
from pipewright.errors import ConfigError
from pipewright.runtime.setup.config import TrainConfig

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    write_tokens(path, np.random.default_rng(0).integers(0, VOCAB, 4000), vocab_size=VOCAB)
    return str(path)


def _config(folder, data: str, **extra) -> TrainConfig:
    return TrainConfig(
        hf_model=str(folder), seq_len=8, microbatch_size=1, microbatches=4, steps=2, data=data,
        progress=False, artifacts=False, eval_every=0, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_stages_give_transformers_logits_and_loss(family, tmp_path, data) -> None:
    from pipewright.cli.check_hf import first_batch_verdict, transformers_rows

    folder = write_config(tmp_path, family, {**FAMILIES, **MOE_FAMILIES}[family])
    config = _config(folder, data)
    config.check()
    first, steps = transformers_rows(config)
    assert first["logits"] <= (2e-7 if family == "gpt2" else 0.0), family
    assert first["loss_ours"] == pytest.approx(first["loss"], rel=1e-6)
    assert first_batch_verdict(first, 1e-5) is None
    assert steps[0]["loss"] == pytest.approx(first["loss"], rel=1e-6) and len(steps) == 2  # by microbatch


def test_unadapted_types_refused_and_moe_flags(tmp_path, data) -> None:
    for family, hf in UNADAPTED.items():
        with pytest.raises(ConfigError, match=rf"model_type '{family}' is not supported: .* differ from"):
            _config(write_config(tmp_path, family, hf), data).check()
    mixtral = _config(write_config(tmp_path, "mixtral", MOE_FAMILIES["mixtral"]), data)
    with pytest.raises(
        ConfigError, match=r"takes its experts from config.json .* 4 experts\); drop --moe-experts"
    ):
        replace(mixtral, moe_experts=4).check()
    with pytest.raises(ConfigError, match=r"--ep 2 shards pipewright's own .* 4 experts that stay whole"):
        replace(mixtral, ep=2, dp=2).check()
    routed = write_config(tmp_path, "routed", {**MOE_FAMILIES["mixtral"], "output_router_logits": True})
    _config(routed, data).check()  # the router loss (test below)
    with pytest.raises(ConfigError, match=r"sets output_router_logits: .* which --cp 2 splits; use --cp 1"):
        _config(routed, data, cp=2).check()
    llama = write_config(tmp_path, "llama", FAMILIES["llama"])  # check found it differing by 3e-3
    with pytest.raises(ConfigError, match=r"^--cp 2 does not support --hf-model yet \(each rank would"):
        _config(llama, data, cp=2).model_spec()


ARGS = ["--seq-len", "8", "--microbatch-size", "1", "--microbatches", "2", "--steps", "2", "--pp", "2"]


def test_check_against_transformers(tmp_path, data, capsys, monkeypatch) -> None:
    folder = write_config(tmp_path, "mixtral", MOE_FAMILIES["mixtral"])
    with forked_cli_launches():
        assert main(["check", "--hf-model", str(folder), "--data", data, *ARGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "equal: 2 steps within 0.0001 (fp32) of transformers"
    assert "equal: 2 steps within 0.0001 (fp32) of one process" in out

    from pipewright.models.hf import adapters

    broken = replace(adapters.ADAPTERS["gpt2"], positions=None)  # the learned positions left out
    monkeypatch.setattr(adapters, "ADAPTERS", {**adapters.ADAPTERS, "gpt2": broken})
    gpt2 = {**FAMILIES["gpt2"], "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    with forked_cli_launches():
        assert (
            main(["check", "--hf-model", str(write_config(tmp_path, "gpt2", gpt2)), "--data", data, *ARGS])
            == 1
        )
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == "dropout disabled for the comparison (resid_pdrop 0.1, embd_pdrop 0.1, attn_pdrop 0.1 set to 0)"
    )
    assert "equal: 2 steps within 0.0001 (fp32) of one process" in out
    assert out[-1].startswith(
        "differs from transformers at the first batch (before step 0): logits differ by"
    )


#: (schedule, pp, dp, virtual, microbatches): 8 sequences a step in each
ROUTER_LAYOUTS = (
    ("1f1b", 2, 2, 1, 4),
    ("interleaved-1f1b", 2, 2, 2, 4),
    ("zbv", 2, 2, 2, 4),
    ("1f1b", 4, 1, 1, 8),
    ("zb-h1", 4, 1, 1, 8),
)


def test_router_loss_as_transformers_on_every_schedule(tmp_path, data) -> None:
    """Mixtral and Qwen2-MoE with ``output_router_logits`` (coefficient 0.5, so the router loss shows):
    the loss (cross-entropy + c·aux) and gradient norm of each of 2 steps equal ``transformers``' model
    trained one microbatch at a time, within 1e-5, on 1F1B (pp 2 and 4), interleaved 1F1B (with full
    recomputation), ZB-V and ZB-H1 (one 4-process launch)."""
    from _queue_spawn import fork_launch
    from _single_process import train_and_gather
    from pipewright.cli.check_hf import transformers_rows
    from pipewright.training import prepare

    cases = []
    for i, (family, hf) in enumerate(MOE_FAMILIES.items()):
        folder = write_config(
            tmp_path, family, {**hf, "output_router_logits": True, "router_aux_loss_coef": 0.5}
        )
        base = _config(folder, data, lr=0.05, warmup=1, optimizer="sgd", out=str(tmp_path / "run"))
        for schedule, pp, dp, v, m in ROUTER_LAYOUTS[i::2]:  # the two families share the layouts
            full = "full" if schedule == "interleaved-1f1b" else "none"  # recomputed layers re-route
            cases.append(
                replace(base, schedule=schedule, pp=pp, dp=dp, virtual=v, microbatches=m, recompute=full)
            )
    runs = [prepare(c) for c in cases]
    gathered = fork_launch(train_and_gather, 4, (runs, None, False), timeout_s=600)[0]
    for config, ranks in zip(cases, gathered, strict=True):
        _, want = transformers_rows(replace(config, microbatches=config.microbatches * config.dp, dp=1, pp=1))
        label = f"{config.hf_model} {config.schedule} pp={config.pp} v={config.virtual}"
        losses = next(r.losses for r in ranks if all(isinstance(x, float) for x in r.losses))
        assert losses == pytest.approx([w["loss"] for w in want], rel=1e-5), label
        assert ranks[0].norms == pytest.approx([w["grad_norm"] for w in want], rel=1e-5), label
    assert {c.schedule for c in cases} == {s for s, *_ in ROUTER_LAYOUTS}


def test_every_moe_option_is_refused_by_its_own_flag() -> None:
    from pipewright.models.hf.support import _moe_values
    from pipewright.models.presets import MOE_FIELDS
    from pipewright.runtime.setup.config import TrainConfig

    flags = {"--" + name.replace("_", "-"): name for name in MOE_FIELDS}
    assert set(_moe_values(TrainConfig())) == set(flags)
    for flag, name in flags.items():
        values = _moe_values(replace(TrainConfig(), **{name: 1}))
        assert [f for f, v in values.items() if v is not None] == [flag]
