"""A plan file applied to a training run (``train --plan PLAN.json``, or a RunSpec whose
``parallelism.plan`` names one): the plan's choices as RunSpec values by path. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipewright.errors import ConfigError
from pipewright.plan.cost_options import RECOMPUTE_ORDER
from pipewright.plan.planfile import Plan, load

Path = tuple[str, ...]
#: The model dimensions a plan was priced with, which a value given for the run must equal.
_DIMENSIONS = ("layers", "hidden", "heads", "vocab", "seq_len")


def plan_values(path: str, given: Mapping[Path, Any] | None = None) -> dict[Path, Any]:
    """The RunSpec values of the plan file at ``path`` for ``train``: the model, degrees, schedule,
    microbatches, layout, recomputation (the strongest of a per-stage choice: the runtime takes one
    mode), ZeRO-1 and the plan's device order. ``given``: the values the run sets itself (flags, the
    ``--config`` file); a model value among them that contradicts the plan is a one-line error, as is
    a plan ``train`` cannot run (FSDP, operator-level recomputation, a microbatch group other than p)."""
    from pipewright.models.presets import preset_names

    plan = load(path)
    model = plan["model"]
    _check_model(path, plan, dict(given or {}))
    modes = plan.data.get("recompute_per_stage") or [plan.data.get("recompute", "none")]
    out: dict[Path, Any] = {
        ("model", "model"): model["name"] if model["name"] in preset_names() else "gpt",
        ("model", "ffn_hidden"): model["ffn_hidden"],
        ("model", "layers"): model["layers"],
        ("model", "hidden"): model["hidden"],
        ("model", "heads"): model["heads"],
        ("model", "vocab"): plan.padded_vocab,  # padded as the plan priced it (≥ the dataset's)
        ("model", "seq_len"): model["seq_len"],
        ("parallelism", "tp"): plan["tp"],
        ("parallelism", "pp"): plan["pp"],
        ("parallelism", "dp"): plan["dp"],
        ("parallelism", "layout"): plan.layout,
        ("schedule", "name"): plan.schedule_csv(path) or plan["schedule"],
        ("batch", "microbatches"): plan["microbatches"],
        ("batch", "microbatch_size"): plan["microbatch_size"],
        ("memory", "recompute"): max(modes, key=RECOMPUTE_ORDER.index),
    }
    _refuse_unrunnable(path, plan, out[("memory", "recompute")])
    if plan["virtual"] > 1:
        out[("parallelism", "virtual")] = plan["virtual"]
    if plan["sequence_parallel"]:
        out[("parallelism", "sequence_parallel")] = True
    for name in ("cp", "ep"):  # ring attention over cp ranks; experts over ep data-parallel ranks
        if plan.data.get(name, 1) != 1:
            out[("parallelism", name)] = plan.data[name]
    if plan.data.get("optimizer_sharding", "none") == "zero1":
        out[("memory", "shard_optimizer")] = True
    place = plan.placement
    if place is not None and place != tuple(range(len(place))):
        out[("parallelism", "placement")] = ",".join(map(str, place))  # rank r on the plan's device r
    return out


def _check_model(path: str, plan: Plan, given: Mapping[Path, Any]) -> None:
    """One line when a given model (a preset) or dimension is not the plan's."""
    from pipewright.models.presets import preset_names

    model = plan["model"]
    name = given.get(("model", "model"))
    if name is not None and name != model["name"] and name in preset_names():
        raise ConfigError(
            f"the plan {path} was made for model {model['name']!r}, not {name!r}; "
            "run `pipewright plan` for this model or drop --model"
        )
    for d in _DIMENSIONS:
        value = given.get(("model", d))
        if value is not None and value != model[d] and not (d == "vocab" and value == plan.padded_vocab):
            raise ConfigError(
                f"the plan {path} was made for a model with {d} {model[d]}, not {value}; "
                "run `pipewright plan` for this model"
            )


def _refuse_unrunnable(path: str, plan: Plan, recompute: str) -> None:
    """One line for a plan whose choices ``train`` does not run."""
    if plan.data.get("optimizer_sharding", "none") == "fsdp":
        raise ConfigError(
            f"the plan {path} uses FSDP, which `pipewright train` does not run; plan with "
            "--optimizer-sharding none,zero1"
        )
    if recompute == "op":
        raise ConfigError(
            f"the plan {path} recomputes with torchtitan's operator-level policy (op), which "
            "`pipewright train` does not run; plan with --recompute none,selective,full"
        )
    if plan.microbatch_group is not None and plan.microbatch_group != plan["pp"]:
        raise ConfigError(
            f"the plan {path} groups interleaved microbatches {plan.microbatch_group} at a time, which "
            "`pipewright train` does not run (its group is p); plan without --microbatch-group"
        )
