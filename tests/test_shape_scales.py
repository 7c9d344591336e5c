"""Measured shapes (``pipewright calibrate``'s per-shape factors, :mod:`pipewright.cost.shape_scales`):
calibrate on vTrain's hidden-1024 sweep from package data meets the ranking targets on the held-out
half; the factors scale exactly the layers' and the ends' passes of the cost model and of the planner;
a shape not measured is priced by the mechanisms alone; a bad ``shapes`` entry is one line."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _cli_json import cli_json
from _vtrain_plan import estimate_and_simulation
from pipewright.cost.calibration import Calibration
from pipewright.cost.measured import VTRAIN_DATA
from pipewright.cost.shape_scales import Shape, ShapeScale, parse_shapes, shape_of, shapes_json
from pipewright.errors import ConfigError

SETUP = [
    *("--gpu", "a100-80gb", "--framework", "deepspeed-megatron", "--dtype", "fp16"),
    *("--attention", "eager", "--recompute", "full", "--grad-reduce", "after"),
]
MODEL = ["--model", "gpt", "--layers", "16", "--hidden", "1024", "--heads", "16", "--vocab", "50257"]
MODEL += ["--seq-len", "1024"]


@pytest.fixture(scope="module")
def vtrain_calibration(tmp_path_factory):
    """``pipewright calibrate`` on the package's vTrain rows: its --json report and the file written."""
    out = tmp_path_factory.mktemp("cal") / "vtrain.json"
    measured = str(resources.files("pipewright.cost").joinpath(VTRAIN_DATA))
    report = cli_json(["calibrate", "--measured", measured, "--out", str(out), *SETUP, "--no-progress"])
    return report, out


def test_calibrate_on_vtrain_meets_the_targets_on_the_held_out_half(vtrain_calibration):
    """The targets through calibrate's report (docs/fidelity.md, "Ranking"): MAPE ≤ 8 %, no
    (tp, microbatch) cell over 15 %, median regret ≤ 3 %, worst ≤ 10 %, median rank correlation ≥
    0.85 (2026-12-07: 1.0 %, −9.6 % at tp 4 microbatch 8, 0.0 %, 9.8 %, 1.00). The two cells the fit
    half does not hold (tp 4 and tp 8 at microbatch 8, 16 rows) are priced by the mechanisms alone,
    which the report gives apart (MAPE 5.5 %, worst regret 18.2 %)."""
    report, _ = vtrain_calibration
    held = report["held_out"]
    assert report["fit_rows"] == 376 and held["rows"] == 344 and report["shapes"] == 14
    assert held["mape"] <= 0.08 and max(abs(e) for e in held["cells"].values()) <= 0.15
    assert held["regret_median"] <= 0.03 and held["regret_worst"] <= 0.10 and held["rank_median"] >= 0.85
    assert report["held_out_unseen_shapes"]["rows"] == 16
    alone = report["held_out_mechanisms"]
    assert alone["regret_worst"] > 0.10 and alone["mape"] > held["mape"]  # what the shapes add


def test_plan_and_simulate_agree_with_measured_shapes(vtrain_calibration, tmp_path):
    """`plan --calibration` with the measured shapes: its quick estimate prices the shapes as the
    simulation does, and `simulate --plan --calibration` prints the plan's prediction to the digit."""
    _, cal = vtrain_calibration
    path = tmp_path / "plan.json"
    flags = ["--nodes", "1", "--gpus-per-node", "8", *SETUP[:-2], "--calibration", str(cal)]
    fixed = ["--tp", "2", "--pp", "4", "--dp", "1", "--global-batch-size", "16", "--no-progress"]
    planned = cli_json(["plan", *MODEL, *flags, *fixed, "--out", str(path)])
    predicted = planned["predicted"]["iteration_time_s"]
    assert cli_json(["simulate", "--plan", str(path), *flags])["iteration_time_s"] == predicted


def test_the_planners_estimate_is_its_simulation_with_measured_shapes(vtrain_calibration):
    """tp 2, pp 4, microbatch 4 (a measured shape): the planner's pieces carry the shape's factors, so
    its estimate equals its simulation, and both differ from the mechanisms alone."""
    _, cal = vtrain_calibration
    times = []
    for calibration in (str(cal), None):
        est, simulated = estimate_and_simulation(2, 4, 4, calibration)
        assert est == pytest.approx(simulated, rel=1e-9)
        times.append(simulated)
    assert times[0] != pytest.approx(times[1], rel=1e-3)


def _cost(calibration: Calibration | None, pp_stage_layers=(4, 4)):
    from pipewright.cost.transformer import TransformerCost
    from pipewright.mesh import Mesh
    from pipewright.models.presets import resolve_model

    spec = resolve_model("gpt", layers=sum(pp_stage_layers), hidden=1024, heads=16, vocab=50257, seq_len=1024)
    return TransformerCost(
        spec=spec,
        microbatch=4,
        gpu="a100-80gb",
        dtype="fp16",
        recompute="full",
        mesh=Mesh(tp=2, pp=len(pp_stage_layers)),
        calibration=calibration,
    )


def _with_shapes(shapes) -> Calibration:
    return Calibration("a100-80gb", "", (), 2.0e12, shapes=shapes)


@pytest.mark.parametrize("kind", ["F", "B"])
def test_the_factors_scale_the_layers_and_the_ends_exactly(kind):
    """A two-stage pipeline of 4 layers each, tp 2, microbatch 4: with factors (k_l, k_e) a middle
    pass of the layers takes k_l × its seconds, an end stage k_l × its layers' + k_e × its embedding's
    or head's; a shape not in the calibration is priced as without it."""
    from pipewright.ir import Action
    from pipewright.schedules.registry import build_schedule

    base = _cost(_with_shapes({}))
    shape = shape_of(base)
    k_l, k_e = 0.8, 1.5
    scaled = _cost(_with_shapes({shape: ShapeScale(k_l, k_e, 5)}))
    sched = build_schedule("1f1b", 2, 4)
    for stage in (0, 1):
        action = Action(stage, kind, 0)
        chunk = base._chunk(stage, sched)
        ends = scaled._ends(stage, 2, base.layers_of(sched))
        assert ends is not None  # built apart once a shape is scaled, as with launches priced
        rank = sched.rank_of(stage)
        end_seconds = sum(base.kind_time(piece, kind, rank) for piece in ends)
        layers = base.kind_time(chunk, kind, rank) - end_seconds
        assert scaled.compute_time(action, sched) == pytest.approx(
            k_l * layers + k_e * end_seconds, rel=1e-12
        )
    other = _cost(_with_shapes({Shape(**{**shape.__dict__, "microbatch": 8}): ShapeScale(k_l, k_e, 5)}))
    action = Action(0, kind, 0)
    assert other.compute_time(action, sched) == base.compute_time(action, sched)


def test_shapes_round_trip_through_the_file():
    shape = Shape("gpt", 1024, 16, 16, 4096, 1024, 50257, 2, 1, 4, "fp16", "full", "eager", False)
    shapes = {shape: ShapeScale(0.85, 0.95, 20)}
    assert parse_shapes(json.loads(json.dumps(shapes_json(shapes))), "f") == shapes


_GOOD = shapes_json(
    {
        Shape("gpt", 1024, 16, 16, 4096, 1024, 50257, 2, 1, 4, "fp16", "full", "eager", False): ShapeScale(
            1.0, 1.0, 3
        )
    }
)[0]


@given(
    key=st.sampled_from(sorted(_GOOD)),
    value=st.one_of(
        st.none(), st.booleans(), st.integers(-3, 0), st.floats(allow_nan=True), st.text(max_size=3)
    ),
)
def test_a_bad_shapes_entry_is_one_line_naming_it(key, value):
    """Any field replaced by a value of the wrong kind or range: a ConfigError naming the entry and the
    field, on one line; or, where the value is still valid for the field, it parses."""
    item = {**_GOOD, key: value}
    try:
        parse_shapes([item], "calibration c.json")
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and message.startswith("calibration c.json: shapes[0]")
        assert repr(key) in message
