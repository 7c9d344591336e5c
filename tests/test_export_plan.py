"""Plans exported for Megatron-LM and torchtitan: three plans (equal chunks, uneven chunks with an
embedding-only and a loss-only chunk, interleaved) load in Megatron-Core's layout parser and
configuration checks and in torchtitan's job-config parser, and both describe the plan's layers per
chunk. The exporter itself is pure Python and always tested; the two trainers' checks run where their
packages are installed (the ``test`` extra installs them)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from _export_flags import megatron_flags as _flags
from pipewright.cli import main
from pipewright.errors import ConfigError
from pipewright.plan.export import chunks
from pipewright.plan.export_megatron import megatron_args
from pipewright.plan.export_torchtitan import torchtitan_config, torchtitan_text
from pipewright.plan.planfile import load, save

BASE = {
    "format": "pipewright-plan",
    "version": 1,
    "model": {
        "name": "gpt-tiny",
        "layers": 8,
        "hidden": 64,
        "heads": 4,
        "ffn_hidden": 256,
        "vocab": 256,
        "seq_len": 64,
        "kv_heads": 4,
        "mlp": "gelu",
        "bias": True,
        "padded_vocab": 256,
    },
    "topology": "1x8-h100-sxm",
    "rank_order": "tp-dp-pp",
    "tp": 2,
    "pp": 4,
    "dp": 1,
    "virtual": 1,
    "schedule": "1f1b",
    "microbatch_size": 2,
    "microbatches": 8,
    "global_batch_size": 16,
    "recompute": "selective",
    "sequence_parallel": True,
    "dtype": "bf16",
    "grad_reduce": "overlap",
    "attention": "flash",
    "cp": 1,
    "optimizer_sharding": "none",
    "tp_comm_overlap": False,
    "layout": "Et*2|t*2|t*2|t*2L",
    "devices": [],
}
PLANS = {
    "uniform": {},
    "uneven": {"layout": "E|t*4|t*4|L", "recompute": "full", "optimizer_sharding": "zero1", "dp": 2},
    "interleaved": {"pp": 2, "virtual": 2, "schedule": "interleaved-1f1b", "tp": 4},
}
#: Layers per chunk, in model order, and where the embedding and the output layer sit.
EXPECTED = {
    "uniform": ([2, 2, 2, 2], 0, 3),
    "uneven": ([0, 4, 4, 0], 0, 3),
    "interleaved": ([2, 2, 2, 2], 0, 3),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plans")
    out = {}
    for name, change in PLANS.items():
        out[name] = folder / f"{name}.json"
        save({**BASE, **change}, out[name])
    return out


@pytest.mark.parametrize("name", PLANS)
def test_the_exports_describe_the_plans_chunks(plans: dict[str, Path], name: str) -> None:
    plan = load(plans[name])
    counts, emb, out = EXPECTED[name]
    parts = chunks(plan)
    assert [len(c.layers) for c in parts] == counts
    assert [c.embedding for c in parts].index(True) == emb and [c.output for c in parts].index(True) == out
    flags = _flags(megatron_args(plan))
    assert (flags["tensor_model_parallel_size"], flags["pipeline_model_parallel_size"]) == (
        plan["tp"],
        plan["pp"],
    )
    assert flags.get("pipeline_model_parallel_layout") == (plan.layout if name == "uneven" else None)
    assert flags.get("num_layers_per_virtual_pipeline_stage") == (2 if name == "interleaved" else None)
    para = torchtitan_config(plan)["parallelism"]
    if name == "uneven":
        assert para["module_fqns_per_model_part"] == [
            ["tok_embeddings"],
            ["layers.0", "layers.1", "layers.2", "layers.3"],
            ["layers.4", "layers.5", "layers.6", "layers.7"],
            ["norm", "output"],
        ]
    else:
        assert para["pipeline_parallel_layers_per_stage"] == 2
    assert para["pipeline_parallel_schedule"] == {"interleaved": "Interleaved1F1B"}.get(name, "1F1B")


def test_megatron_core_reads_the_layouts(plans: dict[str, Path]) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]')")
    import torch
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = set(TransformerConfig.__dataclass_fields__)
    for name, path in plans.items():
        plan = load(path)
        flags = _flags(megatron_args(plan))
        pp, layers = flags["pipeline_model_parallel_size"], flags["num_layers"]
        config = {k: v for k, v in flags.items() if k in fields}
        if "pipeline_model_parallel_layout" in flags:  # Megatron-LM: v from the layout's chunk count
            layout = PipelineParallelLayerLayout(flags["pipeline_model_parallel_layout"], pp)
            layout.validate_layer_layout(layers, None)
            v = layout.virtual_pipeline_model_parallel_size
            per_chunk = [layout.layout[c % pp][c // pp].count(LayerType.decoder) for c in range(pp * v)]
            config["pipeline_model_parallel_layout"] = layout
        elif "num_layers_per_virtual_pipeline_stage" in flags:  # Megatron-LM's validate_args rule
            n = flags["num_layers_per_virtual_pipeline_stage"]
            v = layers // pp // n
            per_chunk = [n] * (pp * v)
        else:
            v, per_chunk = 1, [layers // pp] * pp
        config["virtual_pipeline_model_parallel_size"] = v if v > 1 else None
        TransformerConfig(**config, pipeline_dtype=torch.bfloat16)  # its __post_init__ checks
        assert per_chunk == EXPECTED[name][0], name


def _torchtitan_config_manager():
    """torchtitan's ConfigManager. torchtitan 0.2.2 (the last release that reads TOML job configs)
    imports triton in its package ``__init__`` (quantization → MoE kernels), which the CPU build of
    torch does not ship; the config package itself needs only torch and tyro, so it is imported with
    the package's folder as a bare namespace."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed (pip install -e '.[test]')")
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = [str(Path(spec.origin).parent)]
        sys.modules["torchtitan"] = package
    try:
        from torchtitan.config import ConfigManager
    except ImportError as exc:
        pytest.skip(f"torchtitan's config parser does not import here: {exc}")
    return ConfigManager


def _titan_parts(layers: int, per_stage: int) -> list[list[str]]:
    """torchtitan's ``generate_llm_fqn_per_model_part`` for first/last_stage_less_layers = 0 (its
    module imports triton): ``per_stage`` layers a chunk, the embedding first, norm and output last."""
    parts = [
        [f"layers.{i}" for i in range(s, min(s + per_stage, layers))] for s in range(0, layers, per_stage)
    ]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def test_torchtitan_reads_the_toml(plans: dict[str, Path], tmp_path: Path) -> None:
    manager = _torchtitan_config_manager()
    for name, path in plans.items():
        toml = tmp_path / f"{name}.toml"
        assert main(["export-plan", str(path), "--to", "torchtitan", "-o", str(toml)]) == 0
        job = manager().parse_args(["--job.config_file", str(toml)])
        par, plan = job.parallelism, load(path)
        if par.module_fqns_per_model_part is not None:
            parts = par.module_fqns_per_model_part
        else:
            assert (
                par.pipeline_parallel_first_stage_less_layers,
                par.pipeline_parallel_last_stage_less_layers,
            ) == (0, 0)
            parts = _titan_parts(BASE["model"]["layers"], par.pipeline_parallel_layers_per_stage)
        counts = [sum(m.startswith("layers.") for m in part) for part in parts]
        assert counts == EXPECTED[name][0], name
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
        assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (plan["pp"], plan["tp"])
        assert par.pipeline_parallel_microbatch_size == plan["microbatch_size"]
        assert job.training.local_batch_size * plan["dp"] == plan["global_batch_size"]
        assert job.activation_checkpoint.mode == plan["recompute"]


def test_cli_output_and_one_line_errors(plans: dict[str, Path], tmp_path: Path, capsys) -> None:
    assert main(["export-plan", str(plans["uneven"]), "--to", "megatron"]) == 0
    text = capsys.readouterr().out
    body = text[text.index("MEGATRON_ARGS=(") + len("MEGATRON_ARGS=(") : text.rindex(")")]
    assert _flags(shlex.split(body))["pipeline_model_parallel_layout"] == "E|t*4|t*4|L"
    assert "--use-distributed-optimizer" in body and "--recompute-granularity full" in body
    assert main(["export-plan", str(tmp_path / "none.json"), "--to", "megatron"]) == 2
    assert "does not exist" in capsys.readouterr().err
    v_plan = tmp_path / "v.json"
    save({**BASE, "pp": 2, "virtual": 2, "schedule": "zbv"}, v_plan)
    with pytest.raises(ConfigError, match="places chunks in a V, which Megatron-LM cannot run"):
        megatron_args(load(v_plan))
    assert "ZBVZeroBubble" in torchtitan_text(load(v_plan))


def test_plan_export_writes_beside_the_plan(tmp_path: Path, capsys) -> None:
    out = tmp_path / "q.json"
    argv = ["plan", "--model", "gpt-tiny", "--gpu", "h100-sxm", "--nodes", "1", "--gpus-per-node", "2"]
    argv += [
        "--global-batch-size",
        "4",
        "--schedules",
        "1f1b",
        "--recompute",
        "none",
        "--microbatch-sizes",
        "1",
    ]
    assert main([*argv, "--no-baselines", "--finalists", "1", "--export", "megatron", "-o", str(out)]) == 0
    assert f"wrote {tmp_path / 'q.megatron.sh'}" in capsys.readouterr().out
    text = (tmp_path / "q.megatron.sh").read_text()
    body = text[text.index("MEGATRON_ARGS=(") + len("MEGATRON_ARGS=(") : text.rindex(")")]
    assert _flags(shlex.split(body)) == _flags(megatron_args(load(out)))
