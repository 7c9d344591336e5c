"""The torchtitan 0.3.0 export (``--to torchtitan-0.3``) read by torchtitan 0.3.0's own code: its
``ConfigManager`` parses the arguments (tyro, the config function's ``Trainer.Config``, its checks),
``ParallelDims`` accepts the degrees at the plan's world size with the plan's dp, the model the config
function builds is the plan's model field by field, and the per-stage modules ``pipeline_llm`` would split
(``_get_pipeline_metadata`` and ``_generate_llm_fqn_per_model_part``, or the exported module names) are
the plan's layout and exist in that model built on the meta device. Plans whose model torchtitan 0.3.0
has no config function for (GPT-3, Mixtral) are refused by its ``ConfigManager``.

One torchtitan is installed in an environment: the test extra pins 0.2.2, the last release that reads the
TOML of ``--to torchtitan`` (tests/test_export_trainers.py). The README's test command installs 0.3.0
and the packages it needs beyond the test extra into ``build/torchtitan-0.3.0`` (:data:`INSTALL`), and
torchtitan 0.3.0's code runs in one child process with that folder ahead of site-packages on its path
(running this file as a script: :func:`derive`), which prints what torchtitan derives from each plan's
arguments; the tests here compare that with the plans. Without the folder the module fails where the
``CI`` environment variable is set, and is skipped elsewhere, with the install command as the reason.

Stand-in: torchtitan 0.3.0's models import its expert-parallel kernels module, which imports ``triton``
(no CPU build): an empty ``triton`` module (tests/_stand_ins.py) is in place in the child, after torch's
compiler modules have been imported without it; no kernel is called. The llama3_405b config function's
float8 converter checks for an SM89+ GPU when the config is built: that device query is answered as an
H100's (SM90), and torchao is needed for it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _export_plans import PLANS, ZBV
from _stand_ins import missing
from pipewright.cli import main
from pipewright.models.presets import get_preset
from pipewright.plan.export import chunks
from pipewright.plan.export_megatron import plan_world
from pipewright.plan.export_torchtitan_args import CONFIGS, torchtitan_args
from pipewright.plan.planfile import Plan, save

ALL = {**PLANS, "zbv": ZBV}
ROOT = Path(__file__).resolve().parents[1]
#: The folder the README's test command installs torchtitan 0.3.0 into, and the command.
TARGET = ROOT / "build" / "torchtitan-0.3.0"
INSTALL = (
    "pip install -c constraints.txt --no-deps --upgrade --target build/torchtitan-0.3.0 torchtitan==0.3.0 "
    "spmd_types torch_checkpointing torchao"
)


def test_the_cli_writes_the_arguments(tmp_path, capsys) -> None:
    """``export-plan --to torchtitan-0.3`` prints comment lines and a bash array holding exactly
    :func:`torchtitan_args` (read back with shlex)."""
    save(PLANS["llama3-70b"], tmp_path / "plan.json")
    assert main(["export-plan", str(tmp_path / "plan.json"), "--to", "torchtitan-0.3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# torchtitan 0.3.0 arguments of plan.json: llama3-70b")
    body = text[text.index("TORCHTITAN_ARGS=(") + len("TORCHTITAN_ARGS=(") : text.rindex(")")]
    assert shlex.split(body) == torchtitan_args(Plan(PLANS["llama3-70b"]))


def test_the_readme_test_command_installs_the_folder() -> None:
    """The README's test command, which .ci/run runs word for word, runs :data:`INSTALL`, and each
    package it installs has one version: torchtitan's on the command line, the others' in constraints.txt."""
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(line for line in readme if line.startswith("pip install") and "pytest" in line)
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert INSTALL in command.split(" && ")
    constraints = (ROOT / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in constraints if line and not line.startswith("#"))
    packages = INSTALL.split("build/torchtitan-0.3.0 ")[1].split()
    assert packages[0] == "torchtitan==0.3.0"
    assert all(p in pins for p in packages[1:]), (packages, pins)


def derive(requests: dict[str, dict]) -> dict[str, object]:
    """What torchtitan 0.3.0 makes of each request's ``args`` at its ``world`` size: the degrees of
    ``ParallelDims``, the model fields of the config function's ``model_spec``, the modules of each
    pipeline stage, and those of them missing from the model built on the meta device; or, where
    ``ConfigManager`` refuses the arguments, its message. Runs in the child process (the module docstring)."""
    import importlib.metadata

    import torch
    import torch._dynamo
    import torch._inductor.compile_fx  # imported before the triton stand-in

    from _stand_ins import stand_ins

    with stand_ins(["triton"]):
        import torchtitan
        from torchtitan.components.quantization import float8
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import pipeline_parallel as pp
        from torchtitan.distributed.parallel_dims import ParallelDims

        # llama3_405b's float8 converter asks for an SM89+ GPU when the config is built: answered as an H100's
        float8.has_cuda_capability = lambda major, minor: (major, minor) <= (9, 0)
        out: dict[str, object] = {
            "torchtitan": [importlib.metadata.version("torchtitan"), torchtitan.__file__]
        }
        for name, request in requests.items():
            try:
                job = ConfigManager().parse_args(request["args"])
            except (ValueError, ImportError) as error:
                out[name] = {"refused": f"{type(error).__name__}: {error}"}
                continue
            par = job.parallelism
            dims = ParallelDims.from_config(par, world_size=request["world"])
            model = job.model_spec.model
            layer = model.layers[-1]
            attn, moe = layer.attention, getattr(layer, "moe", None)
            stages, layers, first, last = pp._get_pipeline_metadata(dims, par, model)
            parts = par.module_fqns_per_model_part or pp._generate_llm_fqn_per_model_part(
                stages, layers, first, last
            )
            with torch.device("meta"):
                built = model.build()
            names = {n for n, _ in built.named_modules()}
            out[name] = {
                "degrees": [dims.tp, dims.cp, dims.pp, dims.ep, dims.dp_replicate * dims.dp_shard],
                "model": [len(model.layers), model.dim, model.vocab_size, attn.n_heads],
                "kv_heads": getattr(attn, "n_kv_heads", None) or attn.n_heads,
                "rope_theta": attn.rope.theta,
                "tied": model.enable_weight_tying,
                "moe_layers": [getattr(block, "moe", None) is not None for block in model.layers],
                "experts": [moe.num_experts, moe.router.top_k] if moe else None,
                "ffn": None if moe else layer.feed_forward.w1.out_features,
                "parts": parts,
                "missing": [fqn for part in parts for fqn in part if fqn not in names],
            }
    return out


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> dict[str, object]:
    """:func:`derive` of every plan in :data:`ALL`, run by torchtitan 0.3.0 from :data:`TARGET` in one
    child process."""
    if not (TARGET / "torchtitan").is_dir():
        reason = f"torchtitan 0.3.0 is not in build/torchtitan-0.3.0: {INSTALL} (the README's test command)"
        missing(reason)
    requests = {n: {"args": torchtitan_args(Plan(p)), "world": plan_world(Plan(p))} for n, p in ALL.items()}
    result = tmp_path_factory.mktemp("torchtitan-0.3.0") / "derived.json"
    path = [str(TARGET), os.environ.get("PYTHONPATH", "")]
    child = subprocess.run(
        [sys.executable, __file__, str(result)],
        input=json.dumps(requests),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(result.read_text())


def test_the_child_runs_torchtitan_030_from_the_folder(titan) -> None:
    version, where = titan["torchtitan"]
    assert version == "0.3.0"
    assert Path(where).is_relative_to(TARGET)


@pytest.mark.parametrize("name", ALL)
def test_torchtitan_030_builds_the_plans_model_and_layout(name: str, titan) -> None:
    plan = Plan(ALL[name])
    got = titan[name]
    spec = get_preset(plan["model"]["name"])
    args = torchtitan_args(plan)
    if args[args.index("--config") + 1] not in {c for c, _ in CONFIGS.values()}:  # GPT-3, Mixtral
        assert list(got) == ["refused"]
        assert re.match(
            r"ValueError: Config function .* not found|ImportError: Cannot import", got["refused"]
        ), got["refused"]
        return
    degrees = [plan["tp"], plan.data.get("cp", 1), plan["pp"], plan.data.get("ep", 1), plan["dp"]]
    assert got["degrees"] == degrees
    assert got["model"] == [spec.layers, spec.hidden, spec.vocab, spec.heads]
    assert got["kv_heads"] == spec.kv_heads
    assert got["rope_theta"] == spec.rope_theta
    assert got["tied"] == spec.tied_embeddings
    assert got["moe_layers"] == [spec.is_moe and spec.is_moe_layer(i) for i in range(spec.layers)]
    if spec.is_moe:
        assert got["experts"] == [spec.moe_experts, spec.moe_top_k]
    else:
        assert got["ffn"] == spec.ffn_hidden
    layers = [[int(m.split(".")[1]) for m in part if m.startswith("layers.")] for part in got["parts"]]
    assert layers == [list(c.layers) for c in chunks(plan)]
    assert got["missing"] == []


if __name__ == "__main__":  # the child process of the ``titan`` fixture
    Path(sys.argv[1]).write_text(json.dumps(derive(json.loads(sys.stdin.read()))))
