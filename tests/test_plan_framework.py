"""A plan file records the framework inputs it was priced with (--framework, --grad-dtype, --kernels,
--fsdp-grad-sync, --stage-outputs, --attention-kernel, --microbatch-group):
``simulate --plan FILE`` reproduces the plan's prediction from
the file alone, and plan files without the keys load with the defaults."""

from __future__ import annotations

import json
import shlex

import pytest

from _cli_json import cli_json
from pipewright.cli import main
from pipewright.schedules.classic import interleaved_memory

MODEL = shlex.split(
    "--model llama --layers 4 --hidden 32 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16 "
    "--mlp swiglu --gpu h100-sxm --nodes 1 --gpus-per-node 8 --global-batch-size 32 --tp 1 --pp 2 --dp 4"
)
CLUSTER = ["--gpu", "h100-sxm", "--nodes", "1", "--gpus-per-node", "8"]
FLAGS = [
    *("--kernels", "eager", "--grad-dtype", "bf16", "--fsdp-grad-sync", "step"),
    *("--attention-kernel", "fa3"),
]
FRAMEWORK = ["--framework", "torchtitan"]  # its calibration, and --stage-outputs step by default
PLAN = ["--recompute", "none", "--microbatch-sizes", "1", "--cp", "1", "--no-baselines", "--no-progress"]


def _simulated(argv: list[str]) -> tuple[float, float]:
    got = cli_json(["simulate", *argv])
    return got["iteration_time_s"], got["memory"]["peak_bytes"]


@pytest.fixture(scope="module")
def grouped_plan(tmp_path_factory) -> tuple[str, dict]:
    """Interleaved 1F1B, N = 4 microbatches per group (p = 2, m = 8), pipelined FSDP with the
    framework inputs set away from their defaults."""
    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    argv = ["plan", *MODEL, *PLAN, "--schedules", "interleaved-1f1b", "--microbatch-group", "4"]
    data = cli_json([*argv, "--optimizer-sharding", "fsdp", *FLAGS, *FRAMEWORK, "-o", path])
    return path, data


def test_the_plan_file_records_the_framework_inputs(grouped_plan):
    _, data = grouped_plan
    assert (data["grad_dtype"], data["kernels"], data["fsdp_grad_sync"]) == ("bf16", "eager", "step")
    framework = (data["framework"], data["stage_outputs"], data["attention_kernel"])
    assert framework == ("torchtitan", "step", "fa3")  # torch.distributed.pipelining keeps them to the step
    assert (data["schedule"], data["virtual"], data["microbatches"], data["microbatch_group"]) == (
        "interleaved-1f1b", 2, 8, 4,
    )  # fmt: skip


def test_simulate_plan_reproduces_the_prediction_from_the_file_alone(grouped_plan):
    path, data = grouped_plan
    predicted = (data["predicted"]["iteration_time_s"], data["predicted"]["peak_memory_bytes"])
    from_file = _simulated(["--plan", path, *CLUSTER])
    assert from_file == pytest.approx(predicted, rel=1e-12)
    # the same layout described by flags prices the same
    flags = [
        "--schedule",
        "interleaved-1f1b",
        "--microbatch-group",
        "4",
        "--fsdp",
        "--grad-reduce",
        "overlap",
    ]
    by_flags = _simulated(["--plan", path, *CLUSTER, *flags, *FLAGS, *FRAMEWORK])
    assert by_flags == pytest.approx(predicted, rel=1e-12)
    # a flag given on the command line wins over the plan's
    for flag in (["--framework", "megatron"], ["--stage-outputs", "freed"]):
        assert _simulated(["--plan", path, *CLUSTER, *flag]) != pytest.approx(predicted, rel=1e-6)


def test_an_old_plan_file_without_the_keys_loads_with_the_defaults(grouped_plan, tmp_path):
    _, data = grouped_plan
    old = {
        k: v
        for k, v in data.items()
        if k not in ("grad_dtype", "kernels", "fsdp_grad_sync", "microbatch_group")
        and k not in ("framework", "stage_outputs", "attention_kernel")
    }
    (tmp_path / "old.json").write_text(json.dumps(old))
    got = _simulated(["--plan", str(tmp_path / "old.json"), *CLUSTER])
    flags = ["--fsdp", "--grad-reduce", "overlap", "--microbatch-group", "2"]  # N = p: Megatron's default
    defaults = _simulated(["--plan", str(tmp_path / "old.json"), *CLUSTER, *flags])
    assert got == pytest.approx(defaults, rel=1e-12)
    predicted = (data["predicted"]["iteration_time_s"], data["predicted"]["peak_memory_bytes"])
    assert got[0] != pytest.approx(predicted[0], rel=1e-6) and got[1] != pytest.approx(predicted[1], rel=1e-6)


def test_plan_microbatch_group_sets_the_partitions_memory():
    """The planner's memory per rank is the grouped warm-up's (Megatron-Core's), as simulate's."""
    from pipewright.plan.grouping import in_flight

    assert in_flight("interleaved-1f1b", 2, 8, 2, 4) == [float(x) for x in interleaved_memory(2, 8, 2, 4)]
    assert in_flight("interleaved-1f1b", 2, 8, 2, 4) != in_flight("interleaved-1f1b", 2, 8, 2)
    assert in_flight("1f1b", 2, 8, 1, 4) == in_flight("1f1b", 2, 8, 1)  # 1F1B does not group


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--schedules", "1f1b", "--microbatch-group", "4"], "applies to schedules that group"),
        (
            ["--schedules", "interleaved-1f1b", "--microbatch-group", "0"],
            "--microbatch-group must be at least 1",
        ),
    ],
)
def test_plan_microbatch_group_errors_in_one_line(flags, message, capsys):
    assert main(["plan", *MODEL, *PLAN, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kernels", "jit", '"kernels" must be one of'),
        ("framework", "jax", '"framework" must be one of megatron, torchtitan'),
        ("stage_outputs", "lost", '"stage_outputs" must be one of freed, kept'),
        ("microbatch_group", 1, '"microbatch_group" must be'),
    ],
)
def test_a_bad_framework_input_in_a_plan_file_is_one_line(
    grouped_plan, tmp_path, capsys, key, value, message
):
    _, data = grouped_plan
    (tmp_path / "bad.json").write_text(json.dumps({**data, key: value}))
    assert main(["simulate", "--plan", str(tmp_path / "bad.json"), *CLUSTER]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_plan_searches_operator_recomputation_and_simulate_plan_reproduces_it(tmp_path):
    """``--recompute op`` (torchtitan's operator-level policy) is a planner choice: under a memory limit
    that none misses and op meets, the plan keeps op where it must (per stage), and ``simulate --plan``
    prices the file the same."""
    argv = ["plan", *MODEL, *PLAN[2:], "--schedules", "1f1b", "--optimizer-sharding", "none"]
    layout = cli_json([*argv, "--recompute", "none"])["layout"]
    sim = [
        *MODEL,
        "--schedule",
        "1f1b",
        "--microbatch-size",
        "1",
        "--grad-reduce",
        "overlap",
        "--layout",
        layout,
    ]
    op, none = (_simulated([*sim, "--recompute", mode])[1] for mode in ("op", "none"))
    assert op < none
    path = str(tmp_path / "op.json")
    limit = str((op + none) / 2 / 1e9)
    data = cli_json([*argv, "--recompute", "none,op", "--memory-limit", limit, "-o", path])
    assert "op" in data.get("recompute_per_stage", [data["recompute"]])
    assert data["predicted"]["peak_memory_bytes"] <= float(limit) * 1e9
    predicted = (data["predicted"]["iteration_time_s"], data["predicted"]["peak_memory_bytes"])
    assert _simulated(["--plan", path, *CLUSTER]) == pytest.approx(predicted, rel=1e-12)


def test_op_can_be_chosen_per_stage():
    """A plan's per-stage modes may hold op: each chunk priced by its own mode's cost model."""
    from pipewright.cost.op_recompute import OpRecomputeCost
    from pipewright.cost.recompute import make_cost
    from pipewright.mesh import Mesh
    from pipewright.models.presets import resolve_model
    from pipewright.schedules import build_schedule

    spec = resolve_model(
        "llama", layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16
    )
    kw = {"spec": spec, "gpu": "h100-sxm", "mesh": Mesh(pp=2), "attention": "flash"}
    sched = build_schedule("1f1b", 2, 4)
    mixed = make_cost(per_stage=("op", "full"), **kw)
    op, full = make_cost("op", **kw), make_cost("full", **kw)
    assert isinstance(op, OpRecomputeCost)
    assert mixed._chunk(0, sched) == op._chunk(0, sched) and mixed._chunk(1, sched) == full._chunk(1, sched)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recompute", "op", "--attention", "eager"], "needs --attention flash"),
        (["--recompute", "op", "--moe-experts", "4", "--moe-top-k", "2"], "dense layers only"),
        (["--recompute", "none,fast"], "--recompute takes none, selective, op, full"),
    ],
)
def test_plan_recompute_errors_in_one_line(flags, message, capsys):
    assert main(["plan", *MODEL, *PLAN[2:], "--schedules", "1f1b", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_the_exports_carry_the_group_and_operator_recomputation(grouped_plan, tmp_path, capsys):
    path, data = grouped_plan
    assert main(["export-plan", path, "--to", "megatron"]) == 0
    assert "--microbatch-group-size-per-virtual-pipeline-stage 4" in capsys.readouterr().out
    op = tmp_path / "op.json"
    op.write_text(json.dumps({**data, "recompute": "op"}))
    assert main(["export-plan", str(op), "--to", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "--recompute-granularity selective" in out and "operator-level policy (op)" in out
    assert main(["export-plan", str(op), "--to", "torchtitan"]) == 0
    out = capsys.readouterr().out
    assert 'mode = "selective"' in out and 'selective_ac_option = "op"' in out


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("microbatch_group", 4, "groups interleaved microbatches 4"), ("recompute", "op", "operator-level")],
)
def test_train_plan_refuses_what_the_runtime_does_not_run(grouped_plan, tmp_path, key, value, message):
    from pipewright.errors import ConfigError
    from pipewright.training.plan_values import plan_values

    _, data = grouped_plan
    data = {**data, "optimizer_sharding": "none", "microbatch_group": 2, key: value}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        plan_values(str(tmp_path / "p.json"))
    if key == "microbatch_group":  # N = p is the runtime's own order
        (tmp_path / "p.json").write_text(json.dumps({**data, key: 2}))
        assert plan_values(str(tmp_path / "p.json"))["parallelism", "pp"] == 2


def test_plan_keeps_to_the_recomputation_modes_it_is_given():
    """``--recompute full`` alone offers the planner full recomputation only: the per-stage refinement
    never lightens a stage to a mode the user did not list, though none would be faster and fit."""
    argv = ["plan", *MODEL, *PLAN[2:], "--schedules", "1f1b", "--optimizer-sharding", "none"]
    data = cli_json([*argv, "--recompute", "full"])
    assert set(data.get("recompute_per_stage") or [data["recompute"]]) == {"full"}
    offered = cli_json([*argv, "--recompute", "none,full"])
    assert "none" in (offered.get("recompute_per_stage") or [offered["recompute"]])
