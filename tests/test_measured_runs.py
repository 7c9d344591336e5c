"""Measured runs (``pipewright calibrate``): vTrain's hidden-1024 sweep from package data predicted and
ranked as docs/fidelity.md ("Ranking") states, the file's bad values one line naming the line and
column, the calibration file written once and read by ``simulate``/``plan --calibration``, the host's
launch floor priced alike by the cost model and the planner."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _cli_json import cli_json
from _vtrain_plan import estimate_and_simulation
from pipewright.cli import main
from pipewright.cli.calibrate import flag_setup, predict_all
from pipewright.cost import frameworks
from pipewright.cost.dispatch import combined, dispatch, fused_softmax_runs
from pipewright.cost.measured import TIME, parse_runs, score, spearman, split, vtrain_runs
from pipewright.errors import ConfigError

SETUP = [
    *("--gpu", "a100-80gb", "--vocab", "50257", "--framework", "deepspeed-megatron", "--dtype", "fp16"),
    *("--attention", "eager", "--recompute", "full", "--grad-reduce", "after"),
]
HEADER = (
    "GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)"
)


@pytest.fixture(scope="module")
def vtrain():
    runs = vtrain_runs()
    return runs, predict_all(runs, flag_setup(SETUP))


def test_the_package_holds_vtrains_720_rows_split_in_halves_per_group(vtrain):
    runs, _ = vtrain
    assert len(runs) == 720 and {r.hidden for r in runs} == {1024}
    fit, held = split(runs)
    assert len(fit) + len(held) == 720 and not set(fit) & set(held)
    assert {r.group for r in fit} == {r.group for r in held}  # every group scored on its other half
    assert split(tuple(reversed(runs))) == (fit, held)  # the split does not depend on the file order


def test_vtrain_held_out_half_is_predicted_and_ranked(vtrain):
    """The registered deepspeed-megatron calibration (fitted on the other half): MAPE, median regret,
    rank correlation and every (tp, microbatch) cell within the targets but the named misses, each
    bounded where it stands (the page's): tp 2, microbatch 4 at +15.5 % (the registered constants
    alone; with the measured shapes of `calibrate` +0.2 %, tests/test_shape_scales.py), and the worst
    regret (18.2 %, tp 4 pp 2 microbatch 8 chosen over the measured fastest tp 2 microbatch 4)."""
    runs, predicted = vtrain
    by_run = dict(zip(runs, predicted, strict=True))
    _, held = split(runs)
    s = score(held, [by_run[r] for r in held])
    assert s.mape <= 0.08 and s.regret_median <= 0.03 and s.rank_median >= 0.85
    cell_misses = {(2, 4): 0.156}  # named misses (tp, microbatch) → bound; the others ≤ 15 %
    for cell, e in s.cells.items():
        assert abs(e) <= cell_misses.get(cell, 0.15), cell
    assert all(abs(s.cells[c]) > 0.15 for c in cell_misses), "a named miss is met: remove it"
    assert s.regret_worst <= 0.19
    whole = score(runs, predicted)
    assert whole.mape <= 0.08 and whole.rank_median >= 0.85


def _families(runs):
    """Runs of one (tp, pp, dp, layers, microbatches) by microbatch size: the same kernels and
    collectives per microbatch (tp 8 at microbatch 1 aside: Megatron's unfused softmax there), the
    larger microbatch doing more GPU work in each."""
    out: dict[tuple, dict[int, object]] = {}
    for r in runs:
        if (r.tp, r.microbatch) != (8, 1):
            key = (r.tp, r.pp, r.dp, r.layers, r.global_batch // (r.microbatch * r.dp))
            out.setdefault(key, {})[r.microbatch] = r
    return out


def test_vtrains_tp2_microbatch4_runs_are_faster_than_microbatch2_with_twice_the_work(vtrain):
    """docs/fidelity.md, "Ranking": 45 of the 48 pairs of tp 2 runs alike but for microbatch 2 → 4
    measure faster with twice the samples (median −5.5 %, at most −7.7 %): no model in which time
    grows with the work of a fixed kernel sequence fits both rows of the farthest pair closer than ±4.0 %."""
    runs, _ = vtrain
    pairs = [f for k, f in _families(runs).items() if k[0] == 2 and {2, 4} <= f.keys()]
    changes = sorted(f[4].seconds / f[2].seconds - 1 for f in pairs)
    assert len(pairs) == 48 and sum(c < 0 for c in changes) == 45
    assert changes[0] == pytest.approx(-0.077, abs=5e-4) and changes[23] < -0.05 < changes[24]


def test_a_model_monotone_in_the_work_could_meet_the_ranking_targets(vtrain):
    """The measured times made non-decreasing in the microbatch within each family (the L∞-closest
    such times in log: the mean of the running maximum and the remaining minimum) score the held-out
    half within every target (worst regret 2.2 %, tp 2 microbatch 4 +3.2 %): the anomaly above does
    not by itself rule out the targets; the model's misses are its own (docs/fidelity.md)."""
    runs, _ = vtrain
    bound = {r: r.seconds for r in runs}
    for family in _families(runs).values():
        logs = [math.log(family[b].seconds) for b in sorted(family)]
        for i, b in enumerate(sorted(family)):
            bound[family[b]] = math.exp((max(logs[: i + 1]) + min(logs[i:])) / 2)
    _, held = split(runs)
    s = score(held, [bound[r] for r in held])
    assert s.regret_worst <= 0.03 and max(abs(e) for e in s.cells.values()) <= 0.04
    assert s.cells[(2, 4)] == pytest.approx(0.032, abs=5e-4)


def test_the_worst_regret_needs_tp2_microbatch4_priced_within_10_percent(vtrain):
    """docs/fidelity.md, "Ranking", "What the worst regret needs": with the rows of the two cells the
    worst groups choose (tp 4 microbatch 8, tp 1 microbatch 4) priced at their measured times and every
    other row as the model prices it, the worst regret is still 14.5 % (tp 2 pp 1 dp 4 microbatch 2
    chosen over tp 2 pp 4 microbatch 4); it reaches 10 % only with tp 2 microbatch 4 priced 10 % faster
    too. With every other row exact, tp 2 microbatch 4 priced at most 10 % slow meets the target
    (9.5 %) and 12 % slow does not (11.7 %): the bound holds whatever the model."""
    runs, predicted = vtrain
    by_run = dict(zip(runs, predicted, strict=True))
    _, held = split(runs)

    def regret(exact: set, tp2b4: float, model: bool = True) -> float:
        """Worst regret with the rows of cells ``exact`` at their measured times, tp 2 microbatch 4 at
        ``tp2b4`` × its price, the rest at the model's price (``model``) or their measured times."""
        prices = []
        for r in held:
            cell = (r.tp, r.microbatch)
            price = r.seconds if cell in exact or not model else by_run[r]
            prices.append(price * (tp2b4 if cell == (2, 4) else 1.0))
        return score(held, prices).regret_worst

    both = {(4, 8), (1, 4)}
    assert regret(both, 1.0) == pytest.approx(0.145, abs=5e-4)
    assert regret(both, 0.9) == pytest.approx(0.086, abs=5e-4)
    assert regret(set(), 1.10, model=False) == pytest.approx(0.095, abs=5e-4)
    assert regret(set(), 1.12, model=False) == pytest.approx(0.117, abs=5e-4)


def test_spearman_of_known_orders():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def _row(
    time: str = "10", gpus: str = "4", tp: str = "2", dp: str = "2", pp: str = "1", gbs: str = "8"
) -> str:
    return f"{gpus},{gbs},2,1024,16,12,1024,{tp},{dp},{pp},{time}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# a comment\n" + HEADER.replace(",iteration time (ms)", ",time") + "\n", "no header line"),
        (HEADER.replace("micro batch,", "") + "\n", "line 1: missing column(s) 'micro batch'"),
        (HEADER + "\n" + _row("0"), "line 2, column 'iteration time (ms)': must be a positive finite"),
        (HEADER + "\n" + _row() + "\n" + _row("nan"), "line 3, column 'iteration time (ms)'"),
        (HEADER + "\n" + _row("-3"), "line 2, column 'iteration time (ms)'"),
        (HEADER + "\n" + _row(tp="4"), "line 2, column 'GPUs': tp 4 × dp 2 × pp 1 = 8, not 4"),
        (HEADER + "\n" + _row(gbs="6"), "line 2, column 'global batch'"),
        (HEADER + "\n" + _row().replace(",12,", ",x,"), "line 2, column '# layers': 'x' is not a number"),
    ],
)
def test_bad_runs_are_one_line_naming_line_and_column(text, message):
    with pytest.raises(ConfigError) as exc:
        parse_runs(text, "runs.csv")
    assert message in str(exc.value) and "\n" not in str(exc.value)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_any_time_parses_or_is_refused_in_one_line(value):
    text = f"{HEADER}\n{_row(repr(value))}"
    if math.isfinite(value) and value > 0:
        assert parse_runs(text)[0].seconds == pytest.approx(value / 1e3)
    else:
        with pytest.raises(ConfigError, match=re.escape(f"line 2, column {TIME!r}")):
            parse_runs(text)


def _calibrate(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["calibrate", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_calibrate_writes_once_and_simulate_reads_it(tmp_path):
    """A 12-layer, 2-GPU slice of vTrain's file: the report and the file; no second write without
    --overwrite; bad input writes nothing; simulate --calibration prices with the fitted constants
    and, for a shape the slice measured, its factors (the registered constants alone without them)."""
    rows = [r for r in vtrain_runs() if r.layers == 12 and r.gpus == 2]
    body = "\n".join(_row_of(r) for r in rows)
    runs = tmp_path / "runs.csv"
    runs.write_text(f"# a slice of vTrain's file\n{HEADER}\n{body}\n")
    out = tmp_path / "cal.json"
    flags = ["--measured", str(runs), "--out", str(out), *SETUP[:2], *SETUP[4:], "--no-progress"]
    rc, report, _ = _calibrate(flags)
    assert rc == 0 and "held-out runs, with the measured shapes:" in report and "regret median" in report
    assert "by the mechanisms alone (c, δ):" in report
    data = json.loads(out.read_text())
    assert data["format"] == "pipewright-run-calibration/1" and data["framework"] == "deepspeed-megatron"
    assert data["fit_rows"] + data["held_out"]["rows"] == len(rows)
    rc, _, err = _calibrate(flags)
    assert rc != 0 and "exists; pass --overwrite" in err and err.count("\n") == 1
    bad = tmp_path / "bad.csv"
    bad.write_text(f"{HEADER}\n{_row('0')}\n")
    other = tmp_path / "other.json"
    rc, _, err = _calibrate(["--measured", str(bad), "--out", str(other), *SETUP[:2]])
    assert rc != 0 and "line 2, column 'iteration time (ms)'" in err and not other.exists()
    run = rows[0]
    argv = [
        *("simulate", "--model", "gpt", "--layers", "12", "--hidden", "1024", "--heads", "16"),
        *("--seq-len", "1024", "--nodes", "1", "--gpus-per-node", "2", "--tp", str(run.tp)),
        *("--pp", str(run.pp), "--dp", str(run.dp), "--schedule", "1f1b"),
        *("--microbatch-size", str(run.microbatch), "--global-batch-size", str(run.global_batch), *SETUP),
    ]
    with_file = cli_json([*argv, "--calibration", str(out)])["iteration_time_s"]
    (shape,) = [x for x in data["shapes"] if (x["tp"], x["microbatch"]) == (run.tp, run.microbatch)]
    assert shape["rows"] >= 3 and shape["layers"] != 1.0
    constants = tmp_path / "constants.json"
    constants.write_text(json.dumps({**data, "shapes": []}))
    alone = cli_json([*argv, "--calibration", str(constants)])["iteration_time_s"]
    factors = (1.0, shape["layers"], shape["ends"])  # the unscaled rest: the step, the reductions
    assert min(factors) <= with_file / alone <= max(factors) and with_file != alone
    fw = frameworks.framework("deepspeed-megatron")
    fitted = replace(fw, compute=data["compute"], host_per_kernel=data["host_per_kernel"])
    frameworks.register(fitted, override=True)
    try:
        assert cli_json(argv)["iteration_time_s"] == pytest.approx(alone, rel=1e-12)
    finally:
        frameworks.register(fw, override=True)


def _row_of(r) -> str:
    values = (r.gpus, r.global_batch, r.microbatch, r.hidden, r.heads, r.layers, r.seq_len, r.tp, r.dp, r.pp)
    return ",".join(map(str, values)) + f",{r.seconds * 1e3!r}"


def test_the_launch_floor_is_a_smooth_maximum_of_the_kernels_launched():
    eager = dispatch("eager")
    assert eager.layer_kernels("B", True, 0) == eager.forward + eager.backward
    assert combined(1.0, 0.0) == 1.0 and combined(2.0, 2.0) == pytest.approx(2.0 * 2 ** (1 / 8))
    assert dispatch("graphs").layer_kernels("F", False, 4) == 0.0


@pytest.mark.parametrize(
    ("microbatch", "heads", "seq", "dtype", "runs"),
    [
        (1, 2, 1024, "fp16", False),  # GPT hidden 1024 at tp 8: b × heads = 2
        (2, 2, 1024, "fp16", True),
        (1, 4, 1024, "fp16", True),
        (3, 1, 1024, "bf16", False),
        (4, 16, 4096, "fp16", False),  # sequences over 2048: the unfused path
        (4, 16, 1024, "fp32", False),
        (1, 16, 16, "fp16", False),
    ],
)
def test_megatrons_fused_softmax_runs_where_its_kernel_does(microbatch, heads, seq, dtype, runs):
    """FusedScaleMaskSoftmax.is_kernel_available: 16-bit, 16 < s ≤ 2048, s and b × heads multiples of 4;
    where it does not run, the unfused fp32 path's kernels are launched in F, in I and in the
    recomputed forward."""
    assert fused_softmax_runs(microbatch, heads, seq, dtype) is runs
    model = dispatch("megatron-eager")
    extra_f, extra_b = model.softmax_fallback
    assert model.layer_kernels("F", True, 0, False) == model.layer_kernels("F", True, 0) + extra_f
    assert model.layer_kernels("I", True, 0, False) == model.layer_kernels("I", True, 0) + extra_f + extra_b
    assert model.layer_kernels("W", True, 0, False) == model.layer_kernels("W", True, 0)


def test_plan_and_simulate_agree_to_the_digit_at_pp1_with_dp(tmp_path):
    """A plan fixed at pp 1 with two data-parallel replicas under vTrain's setup (the gradient
    all-reduce and the optimizer step priced): `simulate --plan` prints the plan's prediction."""
    path = tmp_path / "plan.json"
    model = ["--model", "gpt", "--layers", "12", "--hidden", "1024", "--heads", "16", "--vocab", "50257"]
    model += ["--seq-len", "1024"]
    flags = ["--gpu", "a100-80gb", "--nodes", "1", "--gpus-per-node", "4", *SETUP[4:12]]
    fixed = ["--tp", "2", "--pp", "1", "--dp", "2", "--global-batch-size", "32", "--no-progress"]
    planned = cli_json(["plan", *model, *flags, *fixed, "--out", str(path)])
    assert (planned["pp"], planned["dp"]) == (1, 2)
    predicted = planned["predicted"]["iteration_time_s"]
    assert cli_json(["simulate", "--plan", str(path), *flags])["iteration_time_s"] == predicted


@pytest.mark.parametrize("tp, pp, microbatch", [(2, 4, 1), (1, 1, 1), (2, 1, 2), (4, 1, 4)])
def test_the_planners_estimate_is_its_simulation_when_launches_bound(tp, pp, microbatch):
    """GPT hidden 1024 on 8 A100s under deepspeed-megatron's dispatch model (host-bound at b = 1): the
    planner's estimate is its simulation, with a pipeline and without one (both combine the layers',
    the embedding's and the head's launches each with its own GPU time; docs/fidelity.md, "Ranking",
    mechanisms 9 and 12: at pp 1 the estimate was 0.85–0.97 % over before 12)."""
    est, simulated = estimate_and_simulation(tp, pp, microbatch)
    assert est == pytest.approx(simulated, rel=1e-9)


def test_plan_prices_fp8_on_hopper(tmp_path):
    """`plan --dtype fp8 --gpu h100-sxm` plans, and `simulate --plan` gives its prediction."""
    path = tmp_path / "plan.json"
    model = ["--model", "llama", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256"]
    model += ["--seq-len", "32", "--ffn-hidden", "128"]
    cluster_flags = ["--gpu", "h100-sxm", "--nodes", "1", "--gpus-per-node", "4", "--dtype", "fp8"]
    argv = ["plan", *model, *cluster_flags, "--global-batch-size", "8", "--no-progress", "--out", str(path)]
    planned = cli_json(argv)["predicted"]["iteration_time_s"]
    assert cli_json(["simulate", "--plan", str(path), *cluster_flags])["iteration_time_s"] == pytest.approx(
        planned, rel=1e-12
    )


def test_vtrains_own_header_reads_as_it_is():
    """vTrain's file names its first column '# GPUs' on the header line itself."""
    runs = parse_runs(f"# GPUs{HEADER.removeprefix('GPUs')}\n{_row()}\n")
    assert (runs[0].gpus, runs[0].tp, runs[0].dp, runs[0].seconds) == (4, 2, 2, 0.01)


def test_the_published_runs_held_out_median_stays_at_most_six_point_three_percent():
    """The published-runs table the page shows (package data; tests/test_fidelity.py checks each row's
    prediction against it): the held-out rows' median throughput error stays ≤ 6.3 % at the page's
    precision (2026-12-07: 6.305 % over 124 rows, 6.300 % before a100-40gb carried the A100 collective
    step latency)."""
    import csv
    import statistics
    from importlib import resources

    text = resources.files("pipewright.cost").joinpath("data/fidelity_expected.csv").read_text()
    held = [r for r in csv.DictReader(io.StringIO(text)) if r["fit"] == "0"]
    errors = [abs(float(r["predicted"]) / float(r["published"]) - 1) for r in held]
    assert len(held) == 124 and round(statistics.median(errors) * 100, 1) <= 6.3


@pytest.mark.parametrize("fused", [True, False])
def test_megatrons_memory_bound_kernels_on_the_full_hidden_do_not_shrink_with_tp(fused):
    """Megatron's counted bytes (cost.kernels.megatron_layer_bytes): without sequence parallelism the two
    norms, bias-dropout-adds and residual gradient sums run on the full hidden on every rank (22 bytes
    per hidden element forward, 38 backward), the rest splits by tp; the unfused softmax moves
    34 − 4 bytes more per score forward and 42 − 6 backward."""
    from pipewright.cost.kernels import megatron_layer_bytes
    from pipewright.models.presets import resolve_model

    spec = resolve_model("gpt", layers=2, hidden=1024, heads=16, vocab=50257, seq_len=1024)
    one, two, four = (megatron_layer_bytes(spec, t, fused) for t in (1, 2, 4))
    for k, unsplit in ((0, 22), (1, 38)):
        assert 2 * two[k] - one[k] == pytest.approx(unsplit * spec.hidden)
        assert 2 * four[k] - two[k] == pytest.approx(unsplit * spec.hidden)
    fused_fwd, fused_bwd = megatron_layer_bytes(spec, 2, True)
    scores = spec.heads / 2 * spec.seq_len
    assert megatron_layer_bytes(spec, 2, False) == pytest.approx(
        (fused_fwd + 30 * scores, fused_bwd + 36 * scores)
    )


def test_megatron_deepspeeds_head_moves_its_unfused_fp32_loss_bytes():
    """Megatron's cross-entropy on output.float() (38 bytes per logit forward, 14 backward:
    cost.dispatch's megatron-eager loss_bytes) on the last chunk of a deepspeed-megatron cost; its
    embedding and head kept apart from the layers, and from each other, for the launches (chunk.ends)."""
    from pipewright.cost.efficiency import default_efficiency
    from pipewright.cost.transformer import TransformerCost
    from pipewright.hardware import accelerator
    from pipewright.ir import F, I
    from pipewright.models.presets import resolve_model

    spec = resolve_model("gpt", layers=2, hidden=256, heads=4, vocab=1000, seq_len=128)
    eff = frameworks.framework("deepspeed-megatron").efficiency(default_efficiency(accelerator("a100-80gb")))
    cost = TransformerCost(spec, microbatch=2, dtype="fp16", recompute="full", efficiency=eff)
    head, layers = cost.chunk_costs(2, (0, 0, 0)), cost.chunk_costs(1, (0, 2, 0))
    logits = 2 * 128 * 1000
    assert head.traffic[F] == pytest.approx(38 * logits) and head.traffic[I] == pytest.approx(14 * logits)
    whole = cost.chunk_costs(0, (2,))
    assert whole.ends is not None and [(e.layers, e.first, e.last) for e in whole.ends] == [
        (0, True, False),
        (0, False, True),
    ]  # the embedding and the head each a piece of their own
    assert whole.traffic[F] == pytest.approx(layers.traffic[F] + sum(e.traffic[F] for e in whole.ends))
