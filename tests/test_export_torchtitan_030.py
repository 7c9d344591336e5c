"""The torchtitan 0.3.0 export (``--to torchtitan-0.3``) read by torchtitan 0.3.0's own code: its
``ConfigManager`` parses the arguments (tyro, the config function's ``Trainer.Config``, its checks),
``ParallelDims`` accepts the degrees at the plan's world size with the plan's dp, the model the config
function builds is the plan's model field by field, and the per-stage modules ``pipeline_llm`` would split
(``_get_pipeline_metadata`` and ``_generate_llm_fqn_per_model_part``, or the exported module names) are
the plan's layout and exist in that model built on the meta device. Plans whose model torchtitan 0.3.0
has no config function for (GPT-3, Mixtral) are refused by its ``ConfigManager``.

One torchtitan is installed at a time: the test extra pins 0.2.2, the last release that reads the TOML of
``--to torchtitan`` (tests/test_export_trainers.py), so this module is skipped there, with that reason;
it runs where torchtitan 0.3.0 is installed (``pip install --no-deps torchtitan==0.3.0 tyro
spmd_types==0.2.3 torch_checkpointing``). Stand-in: torchtitan 0.3.0's models import its expert-parallel
kernels module, which imports ``triton`` (no CPU build): an empty ``triton`` module (tests/_stand_ins.py)
is in place while these tests run, after torch's compiler modules have been imported without it; no
kernel is called. The llama3_405b config function's float8 converter checks for an SM89+ GPU when the
config is built: that device query is answered as an H100's (SM90), and torchao is needed for it."""

from __future__ import annotations

import importlib.metadata
import shlex
import types

import pytest

from _export_plans import PLANS, ZBV
from _stand_ins import stand_ins
from pipewright.cli import main
from pipewright.models.presets import get_preset
from pipewright.plan.export import chunks
from pipewright.plan.export_megatron import plan_world
from pipewright.plan.export_torchtitan_args import CONFIGS, torchtitan_args
from pipewright.plan.planfile import Plan, save

ALL = {**PLANS, "zbv": ZBV}


def test_the_cli_writes_the_arguments(tmp_path, capsys) -> None:
    """``export-plan --to torchtitan-0.3`` prints comment lines and a bash array holding exactly
    :func:`torchtitan_args` (read back with shlex)."""
    save(PLANS["llama3-70b"], tmp_path / "plan.json")
    assert main(["export-plan", str(tmp_path / "plan.json"), "--to", "torchtitan-0.3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# torchtitan 0.3.0 arguments of plan.json: llama3-70b")
    body = text[text.index("TORCHTITAN_ARGS=(") + len("TORCHTITAN_ARGS=(") : text.rindex(")")]
    assert shlex.split(body) == torchtitan_args(Plan(PLANS["llama3-70b"]))


@pytest.fixture(scope="module")
def titan():
    """torchtitan 0.3.0's config manager, parallel dims and stage split, with the triton stand-in."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not version.startswith("0.3."):
        pytest.skip(
            f"torchtitan {version or '(none)'} is installed; the test extra pins 0.2.2, which reads the "
            "TOML of --to torchtitan; this checks --to torchtitan-0.3 where torchtitan 0.3.0 is installed"
        )
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401  (imported before the triton stand-in)

    with stand_ins(["triton"]):
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import pipeline_parallel
        from torchtitan.distributed.parallel_dims import ParallelDims

        yield types.SimpleNamespace(manager=ConfigManager, dims=ParallelDims, pp=pipeline_parallel)


@pytest.mark.parametrize("name", ALL)
def test_torchtitan_030_builds_the_plans_model_and_layout(name: str, titan, monkeypatch) -> None:
    import torch
    from torchtitan.components.quantization import float8

    # llama3_405b's float8 converter asks for an SM89+ GPU when the config is built: answered as an H100's
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: (major, minor) <= (9, 0))
    plan = Plan(ALL[name])
    args = torchtitan_args(plan)
    spec = get_preset(plan["model"]["name"])
    if args[args.index("--config") + 1] not in {c for c, _ in CONFIGS.values()}:  # GPT-3, Mixtral
        with pytest.raises((ValueError, ImportError), match=r"Config function .* not found|Cannot import"):
            titan.manager().parse_args(args)
        return
    job = titan.manager().parse_args(args)
    par = job.parallelism
    dims = titan.dims.from_config(par, world_size=plan_world(plan))
    assert (dims.tp, dims.cp, dims.pp, dims.ep) == (
        plan["tp"],
        plan.data.get("cp", 1),
        plan["pp"],
        plan.data.get("ep", 1),
    )
    assert dims.dp_replicate * dims.dp_shard == plan["dp"]
    model = job.model_spec.model
    layer = model.layers[-1]
    attn = layer.attention
    assert (len(model.layers), model.dim, model.vocab_size, attn.n_heads) == (
        spec.layers,
        spec.hidden,
        spec.vocab,
        spec.heads,
    )
    assert (getattr(attn, "n_kv_heads", None) or attn.n_heads) == spec.kv_heads
    assert attn.rope.theta == spec.rope_theta
    assert model.enable_weight_tying == spec.tied_embeddings
    if spec.is_moe:
        moe = [getattr(block, "moe", None) is not None for block in model.layers]
        assert moe == [spec.is_moe_layer(i) for i in range(spec.layers)]
        assert (layer.moe.num_experts, layer.moe.router.top_k) == (spec.moe_experts, spec.moe_top_k)
    else:
        assert layer.feed_forward.w1.out_features == spec.ffn_hidden
    stages, layers, first, last = titan.pp._get_pipeline_metadata(dims, par, model)
    parts = par.module_fqns_per_model_part or titan.pp._generate_llm_fqn_per_model_part(
        stages, layers, first, last
    )
    assert [[int(m.split(".")[1]) for m in p if m.startswith("layers.")] for p in parts] == [
        list(c.layers) for c in chunks(plan)
    ]
    with torch.device("meta"):  # the module names exist in the model torchtitan builds
        built = model.build()
    for part in parts:
        for fqn in part:
            built.get_submodule(fqn)
