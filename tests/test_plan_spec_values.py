"""One mapping of a plan onto a RunSpec (:meth:`pipewright.plan.planfile.Plan.spec_values`): what
``plan -o run.toml`` writes, what ``simulate`` prices and what ``train`` runs hold the same value on every
path the three take, for plans of each kind (1F1B, interleaved, zero bubble, context and expert
parallelism, a device placement, an uneven layout, recomputation per stage)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipewright.models.presets import resolve_model
from pipewright.plan.apply import simulate_plan
from pipewright.plan.planfile import CHOSEN, FORMAT, load, model_json, save
from pipewright.plan.run_toml import plan_spec
from pipewright.runspec import defaults, values, with_values
from pipewright.training.plan_values import plan_values


def _plan(model: str = "gpt-small-cpu", layers: int = 8, tied: bool = False, **fields) -> dict:
    spec = replace(resolve_model(model, layers=layers), tied_embeddings=tied)
    data = {"format": FORMAT, "model": model_json(spec), "tp": 1, "pp": 2, "dp": 1, "virtual": 1,
            "schedule": "1f1b", "microbatches": 4, "microbatch_size": 1, "global_batch_size": 4,
            "sequence_parallel": False, "recompute": "none", "layout": "Et*4|t*4L",
            "devices": []}  # fmt: skip
    return data | fields


PLANS = {
    "1f1b": _plan(),
    "interleaved": _plan(
        virtual=2,
        schedule="interleaved",
        microbatches=8,
        global_batch_size=16,
        layout="Et*2|t*2|t*2|t*2L",
        recompute="selective",
    ),
    "zb": _plan(schedule="zb-h1", optimizer_sharding="zero1", dp=2, global_batch_size=8),
    "cp-ep": _plan(
        "gpt-moe-tiny",
        4,
        cp=2,
        ep=2,
        dp=2,
        tp=2,
        sequence_parallel=True,
        layout="Et*2|t*2L",
        global_batch_size=8,
        padded_vocab=258,
    ),
    "placement": _plan(dp=2, global_batch_size=8, placement=[3, 1, 2, 0]),
    "uneven": _plan(layout="Et*5|t*3L", recompute="selective", recompute_per_stage=["full", "selective"]),
    "tied": _plan(tied=True),
}
#: Paths one command does not take from the plan's values, and why: train's microbatches give its global
#: batch and it refuses FSDP; simulate prices the plan's layers per chunk (PlanOverrides).
NOT_TAKEN = {
    "train": {("batch", "global_batch_size"), ("memory", "fsdp")},
    "simulate": {("parallelism", "layout")},
    "plan": set(),
}


def _specs(path: str) -> dict[str, dict]:
    """Each command's RunSpec values with the plan at ``path`` applied."""
    plan = load(path)
    base = with_values(defaults("plan"), {("model", "model"): plan["model"]["name"]})
    simulated, _ = simulate_plan(with_values(defaults("simulate"), {("parallelism", "plan"): path}))
    return {
        "plan": values(plan_spec(base, plan, "run.plan.json")),
        "simulate": values(simulated),
        "train": values(with_values(defaults("train"), plan_values(path))),
    }


@pytest.mark.parametrize("name", PLANS)
def test_plan_simulate_and_train_take_the_same_values(tmp_path, name):
    path = str(tmp_path / "plan.json")
    save(PLANS[name], path)
    expected = load(path).spec_values(path)
    specs = _specs(path)
    for command, spec in specs.items():
        wrong = {
            p: (spec[p], expected[p])
            for p in CHOSEN
            if p not in NOT_TAKEN[command] and spec[p] != expected[p]
        }
        assert not wrong, f"{command}: {wrong}"
    model = [("model", d) for d in ("model", "layers", "hidden", "heads", "ffn_hidden", "seq_len")]
    assert [specs["simulate"][p] for p in model] == [specs["train"][p] for p in model]
    assert specs["train"]["parallelism", "placement"] == ("3,1,2,0" if name == "placement" else None)
    assert specs["plan"]["memory", "recompute"] == ("full" if name == "uneven" else PLANS[name]["recompute"])
    # a tied model's plan is priced tied by simulate and trained tied (plan -o run.toml keeps the plan
    # command's own --tie-embeddings: tests/test_tied_pricing.py)
    assert (
        specs["simulate"]["model", "tie_embeddings"]
        is specs["train"]["model", "tie_embeddings"]
        is (name == "tied")
    )


def test_a_generated_schedule_is_its_csv_for_the_runs_and_its_name_in_the_file(tmp_path):
    path = tmp_path / "plan.json"
    (tmp_path / "order.csv").write_text("")
    save(_plan(schedule="zb-auto", schedule_csv="order.csv"), path)
    csv = str(tmp_path / "order.csv")
    specs = _specs(str(path))
    assert (specs["simulate"]["schedule", "name"], specs["train"]["schedule", "name"]) == (csv, csv)
    assert specs["plan"]["schedule", "name"] == "zb-auto"
