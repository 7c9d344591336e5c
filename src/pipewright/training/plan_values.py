"""A plan file applied to a training run (``train --plan PLAN.json``, or a RunSpec whose
``parallelism.plan`` names one): the plan's choices as RunSpec values by path. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipewright.errors import ConfigError
from pipewright.plan.planfile import CHOSEN, Plan, load

Path = tuple[str, ...]
#: The model dimensions a plan was priced with, which a value given for the run must equal.
_DIMENSIONS = ("layers", "hidden", "heads", "vocab", "seq_len")


#: What ``train`` takes of a plan's values (:meth:`~pipewright.plan.planfile.Plan.spec_values`): what
#: it chose but the global batch (the microbatches give it) and FSDP (refused), the model's preset and
#: dimensions, and the device of each rank.
_TAKEN: tuple[Path, ...] = (
    *(p for p in CHOSEN if p not in {("batch", "global_batch_size"), ("memory", "fsdp")}),
    *(("model", d) for d in ("model", "ffn_hidden", "layers", "hidden", "heads", "seq_len")),
    ("model", "tie_embeddings"),
    ("parallelism", "placement"),
)


def plan_values(path: str, given: Mapping[Path, Any] | None = None) -> dict[Path, Any]:
    """The RunSpec values of the plan file at ``path`` for ``train``: the model (a family's as
    ``gpt``), degrees, schedule (a generated one's CSV), microbatches, layout, recomputation (the
    strongest of a per-stage choice: the runtime takes one mode), ZeRO-1, tied embeddings and the
    plan's device order.
    ``given``: the values the run sets itself (flags, the ``--config`` file); a model value among them
    that contradicts the plan is a one-line error, as is a plan ``train`` cannot run (FSDP,
    operator-level recomputation, a microbatch group other than p)."""
    from pipewright.models.presets import preset_names

    plan = load(path)
    _check_model(path, plan, dict(given or {}))
    values = plan.spec_values(path)
    out = {p: values[p] for p in _TAKEN}
    if out[("model", "model")] not in preset_names():
        out[("model", "model")] = "gpt"
    _refuse_unrunnable(path, plan, out[("memory", "recompute")])
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
