"""``--tp-comm-overlap [MODE]`` under ``--framework`` (pipewright.cost.frameworks): the bare flag names
the framework's own overlap, a mode given wins, ``plan`` takes the option as ``simulate`` does and its
estimate prices the mode with the cost model's rule, plan files record the mode (older ones a boolean)."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _cli_json import cli_json
from pipewright.cli import _parser, main
from pipewright.cost import frameworks
from pipewright.cost.tp_overlap import modes
from pipewright.errors import ConfigError
from pipewright.plan.spec_inputs import tp_comm_overlap

MODEL = shlex.split(
    "--model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16 "
    "--mlp swiglu --gpu h100-sxm --nodes 1 --gpus-per-node 8 --global-batch-size 16 --tp 2 --pp 2 --dp 2 "
    "--recompute none"
)
CLUSTER = ["--gpu", "h100-sxm", "--nodes", "1", "--gpus-per-node", "8"]
PLAN = ["--schedules", "1f1b", "--microbatch-sizes", "1", "--cp", "1", "--no-baselines", "--no-progress"]
#: what each framework's code runs (llm-foundry's tp_config plans PyTorch's Colwise/RowwiseParallel and
#: enables no asynchronous TP; Megatron-DeepSpeed has no --tp-comm-overlap)
OWN = {"megatron": "te", "torchtitan": "async-tp", "llm-foundry": None, "deepspeed-megatron": None}


def _time(argv: list[str]) -> float:
    return cli_json(["simulate", *argv])["iteration_time_s"]


@pytest.mark.parametrize("name", sorted(OWN))
def test_the_bare_flag_names_each_frameworks_own_mode_and_a_mode_given_wins(name):
    assert frameworks.framework(name).tp_overlap == OWN[name]
    for first in (["--framework", name], []):  # either order on the command line
        for mode in (None, *modes()):
            flag = ["--tp-comm-overlap", *([mode] if mode else [])]
            args = _parser((), "simulate").parse_args(
                ["simulate", *first, *flag, *([] if first else ["--framework", name])]
            )
            if mode is not None:
                assert tp_comm_overlap(args.spec) == mode
            elif OWN[name] is not None:
                assert tp_comm_overlap(args.spec) == OWN[name]
            else:
                with pytest.raises(ConfigError, match=f"^--framework {name} runs no tensor-parallel overlap"):
                    tp_comm_overlap(args.spec)
    assert frameworks.tp_comm_overlap(False, name) == "none"
    assert frameworks.tp_comm_overlap(True, None) == "te"  # the default framework's


def test_a_framework_names_a_registered_overlap():
    with pytest.raises(ConfigError, match="tp_overlap must be one of te, async-tp or None"):
        frameworks.Framework("probe", "", tp_overlap="none")


def test_simulate_prices_the_frameworks_mode_for_the_bare_flag():
    argv = [*MODEL, "--schedule", "1f1b", "--sequence-parallel", "--framework", "torchtitan"]
    assert _time([*argv, "--tp-comm-overlap"]) == _time([*argv, "--tp-comm-overlap", "async-tp"])


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[str, dict]:
    """A plan for torchtitan with the bare flag (so its asynchronous TP), tp = 2."""
    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    argv = ["plan", *MODEL, *PLAN, "--framework", "torchtitan", "--tp-comm-overlap", "-o", path]
    return path, cli_json(argv)


def test_the_plan_records_the_mode_and_simulate_plan_prices_it(planned):
    path, data = planned
    assert data["tp_comm_overlap"] == "async-tp" and data["sequence_parallel"] is True
    predicted = data["predicted"]["iteration_time_s"]
    assert _time(["--plan", path, *CLUSTER]) == pytest.approx(predicted, rel=1e-12)
    assert _time(["--plan", path, *CLUSTER, "--tp-comm-overlap", "te"]) < predicted  # a flag given wins


def test_an_old_plan_files_boolean_loads_as_the_bare_flag_then(planned, tmp_path):
    """true was the bare flag when plans recorded a boolean: Transformer Engine's overlap, whatever
    the plan's framework; false no overlap."""
    path, data = planned
    for old, mode in ((True, "te"), (False, "none")):
        (tmp_path / "old.json").write_text(json.dumps({**data, "tp_comm_overlap": old}))
        got = _time(["--plan", str(tmp_path / "old.json"), *CLUSTER])
        assert got == _time(["--plan", path, *CLUSTER, "--tp-comm-overlap", mode])


def test_the_planners_estimate_prices_the_mode_with_the_cost_models_rule():
    """Per layer, what async-tp hides beyond no overlap is the cost model's (its rule on a one-layer
    chunk), in the forward and the backward."""
    from pipewright.cost.comm import Mesh
    from pipewright.cost.recompute import make_cost
    from pipewright.cost.tp_overlap import chunk_pass
    from pipewright.cost.transformer import A100_EFFICIENCY
    from pipewright.hardware import accelerator
    from pipewright.ir import B, F
    from pipewright.models.presets import resolve_model
    from pipewright.plan.cost_options import CostOptions
    from pipewright.plan.costs import parts
    from pipewright.topology import single_host

    spec = resolve_model(
        "llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=16
    )
    cost = make_cost(
        "none", spec=spec, microbatch=2, gpu="a100-80gb", dtype="bf16", mesh=Mesh(tp=4),
        sequence_parallel=True, topology=single_host(4, "a100-80gb"), efficiency=A100_EFFICIENCY,
        attention="flash",
    )  # fmt: skip
    gpu = accelerator("a100-80gb")

    def all_reduce(x: float) -> float:
        return 1e3 * cost.comm.tp_all_reduce_time(0, x)  # slow links: every collective outlasts its GEMM

    chunk = cost.chunk_costs(1, (0, 1, 0))
    for i, kind in enumerate((F, B)):
        est = {}
        for mode in modes():
            pc = parts(spec, 2, 4, "none", True, "bf16", A100_EFFICIENCY, CostOptions(tp_comm_overlap=mode))
            est[mode] = pc.layer.times(gpu, "bf16", A100_EFFICIENCY, all_reduce, options=pc.pricing)[i]
        collectives = tuple(map(all_reduce, chunk.tp_bytes[kind]))
        rule = {
            m: modes()[m].exposed_time(chunk_pass(cost, chunk, kind, 0, 0.0, collectives)) for m in modes()
        }
        hidden = rule["none"] - rule["async-tp"]
        assert hidden > 0 and est["none"] - est["async-tp"] == pytest.approx(hidden, rel=1e-9)
        assert est["none"] > est["async-tp"] > est["te"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", *MODEL, *PLAN, "--tp-comm-overlap", "fast"],
            "--tp-comm-overlap must be one of none, te, async-tp",
        ),
        (["simulate", *MODEL, "--schedule", "1f1b", "--tp-comm-overlap", "fast"], "must be one of none, te"),
        (
            ["plan", *MODEL, *PLAN, "--framework", "llm-foundry", "--tp-comm-overlap"],
            "runs no tensor-parallel",
        ),
    ],
)
def test_a_bad_mode_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


@settings(max_examples=20, deadline=None)
@given(value=st.text(max_size=12), name=st.sampled_from(sorted(OWN)))
def test_any_other_mode_is_refused_in_one_line_under_any_framework(value, name):
    if value in modes():
        assert frameworks.tp_comm_overlap(value, name) == value
        return
    with pytest.raises(ConfigError) as exc:
        frameworks.tp_comm_overlap(value, name)
    assert str(exc.value) == f"--tp-comm-overlap must be one of none, te, async-tp (got {value!r})"


def test_a_bad_mode_in_a_plan_file_is_one_line(planned, tmp_path, capsys):
    _, data = planned
    (tmp_path / "bad.json").write_text(json.dumps({**data, "tp_comm_overlap": "fast"}))
    assert main(["simulate", "--plan", str(tmp_path / "bad.json"), *CLUSTER]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and '"tp_comm_overlap" must be one of none, te, async-tp' in err


def test_the_exports_run_their_own_overlap_and_say_so(planned, tmp_path, capsys):
    path, data = planned
    assert main(["export-plan", path, "--to", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert "enable_async_tensor_parallel = true" in out and "--tp-comm-overlap" not in out
    assert main(["export-plan", path, "--to", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "  --tp-comm-overlap" in out and "the plan prices --tp-comm-overlap async-tp" in out
    te = tmp_path / "te.json"
    te.write_text(json.dumps({**data, "tp_comm_overlap": True}))
    assert main(["export-plan", str(te), "--to", "megatron"]) == 0
    assert "note: the plan prices --tp-comm-overlap" not in capsys.readouterr().out


def test_the_docs_table_shows_each_frameworks_mode():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "cost-model.md").read_text()
    table = doc.split("| `--framework` | bare `--tp-comm-overlap` |")[1].split("\n\n")[0]
    rows = [line.split("|") for line in table.splitlines()[2:]]
    cells = {row[1].split("`")[1]: row[2] for row in rows}
    assert set(cells) == set(frameworks.names())
    for name, cell in cells.items():
        mode = frameworks.framework(name).tp_overlap
        assert (f"`{mode}`" if mode else "—") in cell


def test_exports_turn_the_overlap_on_only_where_the_trainer_runs_it(planned, tmp_path, capsys):
    """torchtitan runs async TP on compiled blocks only: its export turns compile on with it. Megatron-LM
    asserts --tp-comm-overlap runs with sequence parallelism, which it turns off at tp 1: no flag there."""
    path, data = planned
    assert main(["export-plan", path, "--to", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert "enable_async_tensor_parallel = true" in out and "[compile]" in out and "enable = true" in out
    assert main(["export-plan", path, "--to", "megatron"]) == 0
    assert "--tp-comm-overlap" in _arguments(capsys.readouterr().out)
    tp1 = tmp_path / "tp1.json"
    tp1.write_text(json.dumps({**data, "tp": 1, "dp": 4, "sequence_parallel": False}))
    assert main(["export-plan", str(tp1), "--to", "megatron"]) == 0
    assert "--tp-comm-overlap" not in _arguments(capsys.readouterr().out)
    assert main(["export-plan", str(tp1), "--to", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert "enable_async_tensor_parallel = false" in out and "[compile]" not in out


def _arguments(text: str) -> list[str]:
    """The words of an export outside its comment lines (notes may name a flag)."""
    return [w for line in text.splitlines() if not line.startswith("#") for w in line.split()]
