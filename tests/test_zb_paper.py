"""Zero Bubble (Qi et al., ICLR 2024) Table 4: ZB-2p's throughput over 1F1B, predicted within 3 points of
the paper's, with ZB-2p run as the paper runs it — optimizer post-validation (§4), so consecutive
iterations overlap: ``simulate --iterations 3 --no-step-barrier``, the steady period. 1F1B's prediction
is the one docs/fidelity.md shows (tests/test_fidelity.py checks it against the simulation); ZB-1p's
gain is tested there (the barrier changes it by less than 0.3 point).

28.3B (32 stages, m = 128) is held to a range instead: the paper prints its throughputs as 0.8 (1F1B)
and 1.0 (ZB-2p) samples per GPU per second, one decimal, so the published ratio is only known to lie
in 0.95/0.85 … 1.05/0.75 = 1.12 … 1.40 (1.250 as printed; predicted 1.209)."""

import contextlib
import csv
import io
import json
from importlib import resources

import pytest

from pipewright.cli import main
from pipewright.cost.fidelity import load_runs
from pipewright.cost.published_specs import COMMAND, published_spec
from pipewright.runspec import spec_to_argv

RUNS = {r.id: r for r in load_runs()}
EXPECTED = {
    row["id"]: row
    for row in csv.DictReader(
        resources.files("pipewright.cost").joinpath("data/fidelity_expected.csv").read_text().splitlines()
    )
}


def _predicted_gain(model: str) -> tuple[float, float]:
    """(predicted, published) ZB-2p over 1F1B throughput for one model of Table 4."""
    base, zb = RUNS[f"zb-a100-{model}-1f1b"], RUNS[f"zb-a100-{model}-zb-2p"]
    assert zb["schedule"] == "zb-h2"
    published = float(EXPECTED[zb.id]["published"]) / float(EXPECTED[base.id]["published"])
    # tokens per second scale as 1 / iteration time: the 1F1B row's predicted tokens/s gives its time
    tokens = base.int("global_batch_size") * base.seq / base.gpus
    base_time = tokens / float(EXPECTED[base.id]["predicted"])
    spec = published_spec(zb.id)  # post-validation: the steady period of three iterations, no barrier
    assert (spec.simulation.iterations, spec.simulation.no_step_barrier) == (3, True)
    steady = _iteration_time([COMMAND, *spec_to_argv(spec, COMMAND)])
    return base_time / steady, published


def _iteration_time(argv: list[str]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())["iteration_time_s"]


@pytest.mark.parametrize("model", ["1.5b-m32", "6.2b-m32", "14.6b-m64"])
def test_zb2p_gain_within_three_points_with_post_validation(model):
    predicted, published = _predicted_gain(model)
    assert predicted == pytest.approx(published, abs=0.03)


def test_zb2p_gain_at_28b_within_what_the_printed_throughputs_allow():
    predicted, published = _predicted_gain("28.3b-m128")
    assert published == pytest.approx(1.0 / 0.8)  # as printed, one decimal each
    assert 0.95 / 0.85 <= predicted <= 1.05 / 0.75
