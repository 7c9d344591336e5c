"""The plan file ``pipewright plan`` writes and ``simulate --plan`` / ``train --plan`` read.

Schema (JSON)::

    {"format": "pipewright-plan", "version": 1,
     "model": {"name": "gpt3-175b", "layers": 96, "hidden": 12288, "heads": 96, "ffn_hidden": 49152,
               "vocab": 50257, "padded_vocab": 50688, "seq_len": 2048},   # padded: 128·t multiple

     "topology": "128x8-a100-80gb", "devices": ["node0/gpu0", …],   # device of global rank g
     "rank_order": "tp-dp-pp", "placement": [0, 1, …],   # g's device index (Mesh placement)
     "tp": 8, "pp": 8, "dp": 16, "virtual": 1, "schedule": "1f1b",
     "microbatch_size": 1, "microbatches": 96, "global_batch_size": 1536,
     "recompute": "selective", "sequence_parallel": true, "dtype": "bf16",
     "recompute_method": "block", "recompute_num_layers": 2,   # with full only, where given
     "grad_reduce": "overlap",                      # where the iteration's gradient all-reduce runs
     "tp_comm_overlap": "te",   # the --tp-comm-overlap mode priced (none, te, async-tp; older: a boolean)
     "framework": "megatron", "grad_dtype": "fp32", "kernels": "fused",   # how the framework runs
     "fsdp_grad_sync": "microbatch", "stage_outputs": "freed",   # (simulate's flags; older plans:
     "attention_kernel": null, "cp_comm": "transformer-engine",  # these defaults; null: the GPU's usual)
     "microbatch_group": 16,                        # interleaved only, where --microbatch-group was given
     "layout": "Et*12|t*12|…|t*12L",                                 # models/layout.py's string
     "predicted": {"iteration_time_s": …, "peak_memory_bytes": …},
     "baselines": [{"name": "megatron", "iteration_time_s": …, "config": "…"}, …],
     "runner_ups": [{"config": "…", "iteration_time_s": …, "why": "…"}, …]}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipewright.cost.attention_kernels import KERNEL_NAMES
from pipewright.cost.chunk_memory import STAGE_OUTPUTS
from pipewright.cost.cp_impls import names as cp_comm_names
from pipewright.cost.kernels import KERNELS
from pipewright.cost.sharding import GRAD_DTYPE_BYTES, GRAD_SYNC
from pipewright.cost.tp_overlap import modes as tp_overlap_modes
from pipewright.cost.tp_overlap import resolve as resolve_tp_overlap
from pipewright.errors import ConfigError
from pipewright.mesh import DEFAULT_ORDER
from pipewright.models.presets import MOE_FIELDS
from pipewright.models.spec import ModelSpec
from pipewright.topology.schema import read as read_json
from pipewright.topology.schema import save as write_json

FORMAT = "pipewright-plan"
SpecPath = tuple[str, ...]
#: Where the planner's iteration runs the data-parallel gradient all-reduce (``simulate --grad-reduce``):
#: each stage's right after its last backward, as ``pipewright train``'s executor does.
GRAD_REDUCE_PLANNED = "overlap"
_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len")
#: The model's dimensions a plan records that a RunSpec's ``model`` section takes as they are (the
#: vocabulary: the padded one the plan priced, :attr:`Plan.padded_vocab`).
MODEL_DIMS = ("layers", "hidden", "heads", "ffn_hidden", "seq_len", "kv_heads", "mlp")
#: The RunSpec paths of what a plan's search chose (:meth:`Plan.spec_values`): every command that reads
#: a plan takes these from it.
CHOSEN: tuple[SpecPath, ...] = (
    *(("parallelism", k) for k in ("tp", "pp", "dp", "virtual", "sequence_parallel", "cp", "ep", "layout")),
    ("schedule", "name"),
    *(("batch", k) for k in ("microbatch_size", "microbatches", "global_batch_size")),
    *(("memory", k) for k in ("recompute", "shard_optimizer", "fsdp")),
    ("model", "vocab"),
)
#: The architecture beyond the dimensions a plan records (ModelSpec's fields), so that an export builds
#: the model the plan priced (plan/export_model.py); the mixture-of-experts fields with experts only.
ARCH_FIELDS = ("family", "tied_embeddings", "rope_theta", "attention_kind", "mtp_depth")
#: The framework inputs a plan records (``simulate``'s and ``plan``'s flags of the same names: the
#: RunSpec's framework and memory sections), their values and their defaults (what a plan without the
#: key was priced with).
#: ``framework``'s values are the registered frameworks (:func:`pipewright.cost.frameworks.names`);
#: ``attention_kernel``'s default None is the accelerator's usual kernel.
FRAMEWORK_INPUTS: dict[str, tuple[tuple[str, ...] | None, str | None]] = {
    "framework": (None, "megatron"),
    "grad_dtype": (tuple(GRAD_DTYPE_BYTES), "fp32"),
    "kernels": (KERNELS, "fused"),
    "fsdp_grad_sync": (GRAD_SYNC, "microbatch"),
    "stage_outputs": (STAGE_OUTPUTS, "freed"),
    "attention_kernel": (KERNEL_NAMES, None),
    "cp_comm": (cp_comm_names(), "transformer-engine"),
}


def framework_inputs(given: Iterable[tuple[str, object]] = ()) -> dict[str, object]:
    """The plan file's framework inputs: each of :data:`FRAMEWORK_INPUTS`, the ``given`` value or
    its default (a plan states every input it was priced with)."""
    values = dict(given)
    return {key: values.get(key) or default for key, (_, default) in FRAMEWORK_INPUTS.items()}


def _choices(key: str) -> tuple[str, ...]:
    """The values a plan file may give framework input ``key``."""
    choices = FRAMEWORK_INPUTS[key][0]
    if choices is None:  # the frameworks registered now
        from pipewright.cost.frameworks import names

        return names()
    return choices


@dataclass(frozen=True)
class Plan:
    """A plan read back from its file (the fields the commands apply)."""

    data: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def layout(self) -> str:
        return self.data["layout"]

    @property
    def devices(self) -> list[str]:
        return list(self.data["devices"])

    @property
    def placement(self) -> tuple[int, ...] | None:
        """The device index of each global rank (mesh order ``tp-dp-pp``), or None: the given order."""
        place = self.data.get("placement")
        return tuple(place) if place else None

    def schedule_csv(self, plan_path: str | Path) -> str | None:
        """The generated schedule's CSV (beside the plan file), or None for a schedule built by name."""
        name = self.data.get("schedule_csv")
        if not name:
            return None
        path = Path(plan_path).parent / name
        if not path.is_file():
            raise ConfigError(f"the plan's schedule file {path} is missing; keep it beside the plan")
        return str(path)

    def spec_values(self, plan_path: str | Path | None = None) -> dict[SpecPath, Any]:
        """Every value the plan states that a RunSpec field holds, by path: what the search chose
        (:data:`CHOSEN`: the sizes, the schedule, the batch, the layout, the recomputation (the strongest
        of a per-stage choice: a run takes one mode; simulate prices each stage's from the plan's data),
        the optimizer sharding, the vocabulary priced, padded to 128·t), the model (its preset or family
        and :data:`MODEL_DIMS`), the device of each rank (``parallelism.placement``; None for the given
        order) and the cost-model inputs the plan was priced with (the framework's, the gradient
        reduction, the calibration, the microbatch group, Megatron's partial recomputation).
        ``plan_path``: the plan file's own path, where a generated schedule's CSV is found (the schedule
        is then that file; without ``plan_path``: the schedule's name).

        The one mapping of a plan onto a spec: ``plan -o run.toml``
        (:func:`pipewright.plan.run_toml.plan_spec`), ``simulate``
        (:func:`pipewright.plan.apply.simulate_plan`) and ``train``
        (:func:`pipewright.training.plan_values.plan_values`) each take their paths of it."""
        from pipewright.plan.cost_options import RECOMPUTE_ORDER
        from pipewright.plan.spec_inputs import FRAMEWORK_DEFAULTABLE

        d = self.data
        modes = d.get("recompute_per_stage") or [d.get("recompute", "none")]
        sharding, overlap, place = d.get("optimizer_sharding", "none"), self.tp_comm_overlap, self.placement
        csv = self.schedule_csv(plan_path) if plan_path is not None else None
        b = d["microbatch_size"]
        return {
            ("parallelism", "tp"): d["tp"],
            ("parallelism", "pp"): d["pp"],
            ("parallelism", "dp"): d["dp"],
            ("parallelism", "virtual"): d.get("virtual", 1),
            ("parallelism", "sequence_parallel"): bool(d.get("sequence_parallel", False)),
            ("parallelism", "cp"): d.get("cp", 1),
            ("parallelism", "ep"): d.get("ep", 1),
            ("parallelism", "layout"): self.layout,
            ("schedule", "name"): csv or d["schedule"],
            ("batch", "microbatch_size"): b,
            ("batch", "microbatches"): d["microbatches"],
            ("batch", "global_batch_size"): d.get("global_batch_size") or b * d["microbatches"] * d["dp"],
            ("memory", "recompute"): max(modes, key=RECOMPUTE_ORDER.index),
            ("memory", "shard_optimizer"): sharding == "zero1",
            ("memory", "fsdp"): sharding == "fsdp",
            ("model", "vocab"): self.padded_vocab,
            **self._model_values(),
            ("parallelism", "placement"): (
                None if place is None or place == tuple(range(len(place))) else ",".join(map(str, place))
            ),
            ("framework", "grad_reduce"): self.grad_reduce,
            ("framework", "attention"): self.attention,
            ("framework", "tp_comm_overlap"): False if overlap == "none" else overlap,
            ("framework", "name"): self.framework_input("framework"),
            ("cluster", "calibration"): d.get("calibration"),
            ("schedule", "microbatch_group"): self.microbatch_group,
            ("memory", "recompute_method"): d.get("recompute_method"),
            ("memory", "recompute_num_layers"): d.get("recompute_num_layers"),
            **{path: self.framework_input(key) for key, path in FRAMEWORK_DEFAULTABLE.items()},
        }

    def _model_values(self) -> dict[SpecPath, Any]:
        """The plan's model: its preset or family, the dimensions it records, ``no_bias`` for a
        model without biases and ``tie_embeddings`` for one whose output layer is tied (priced so)."""
        model = self.data["model"]
        out: dict[SpecPath, Any] = {("model", "model"): model["name"]}
        out |= {("model", d): model[d] for d in MODEL_DIMS if d in model}
        out[("model", "no_bias")] = model.get("bias") is False
        out[("model", "tie_embeddings")] = model.get("tied_embeddings") is True
        return out

    def chunk_layers(self) -> tuple[int, ...]:
        from pipewright.models.layout import parse_layout

        return tuple(len(s.layers) for s in parse_layout(self.layout).stages)

    @property
    def padded_vocab(self) -> int:
        """The vocabulary the plan was priced with (padded to 128·t, as Megatron does); older plans: the
        model's."""
        model = self.data["model"]
        return int(model.get("padded_vocab") or model["vocab"])

    @property
    def attention(self) -> str:
        """The attention kernel the plan was priced with (older plans: eager)."""
        return str(self.data.get("attention", "eager"))

    def framework_input(self, key: str) -> str | None:
        """A framework input the plan was priced with (:data:`FRAMEWORK_INPUTS`; older plans: its
        default)."""
        return self.data.get(key) or FRAMEWORK_INPUTS[key][1]

    @property
    def microbatch_group(self) -> int | None:
        """Interleaved 1F1B's microbatch group N the plan was priced with (None: p, Megatron's default)."""
        return self.data.get("microbatch_group")

    @property
    def tp_comm_overlap(self) -> str:
        """The ``--tp-comm-overlap`` mode the plan was priced with (:mod:`pipewright.cost.tp_overlap`);
        older plans' boolean: true was the bare flag, Transformer Engine's overlap (``te``)."""
        return resolve_tp_overlap(self.data.get("tp_comm_overlap", False))

    @property
    def grad_reduce(self) -> str:
        return str(self.data.get("grad_reduce", GRAD_REDUCE_PLANNED))

    def check_model(self, spec: ModelSpec) -> None:
        """One-line error when the plan was made for a model of other dimensions (the vocabulary may be
        the model's or the plan's padded one)."""
        model = self.data["model"]

        def same(d: str) -> bool:
            value = getattr(spec, d)
            return model.get(d) == value or (d == "vocab" and value == self.padded_vocab)

        diff = [f"{d} {model[d]} (plan) vs {getattr(spec, d)}" for d in _DIMS if not same(d)]
        if diff:
            raise ConfigError(
                f"the plan was made for model {model.get('name')!r}, not this one ({'; '.join(diff)}); "
                "run `pipewright plan` for this model or pass the plan's model"
            )


def model_json(spec: ModelSpec, padded_vocab: int | None = None) -> dict[str, Any]:
    """The plan's "model": the dimensions, and the padded vocabulary the plan was priced with."""
    out: dict[str, Any] = {"name": spec.name, **{d: getattr(spec, d) for d in _DIMS}}
    out["kv_heads"] = spec.kv_heads
    for key in ("mlp", "bias"):  # the model's shape beyond the dimensions, where the spec has it
        if hasattr(spec, key):
            out[key] = getattr(spec, key)
    out |= {key: getattr(spec, key) for key in ARCH_FIELDS}
    if spec.is_moe:
        out |= {key: getattr(spec, key) for key in MOE_FIELDS}
    if padded_vocab is not None:
        out["padded_vocab"] = padded_vocab
    return out


def save(data: dict[str, Any], path: str | Path) -> None:
    """Write a plan file (indented JSON, as topology files are)."""
    write_json(data, path)


def load(path: str | Path) -> Plan:
    """Read a plan file; one-line error on a missing, unreadable or non-JSON file
    (:func:`pipewright.topology.schema.read`) or another format."""
    from pipewright.files import naming

    data = read_json(path, "plan")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f'{path} is not a plan file: expected "format": "{FORMAT}"')
    with naming(path, "plan"):
        check_schema(data, str(path))
    return Plan(data)


_POSITIVE = ("tp", "pp", "dp", "virtual", "microbatch_size", "microbatches")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_schema(data: dict[str, Any], where: str = "plan") -> None:
    """One-line ConfigError unless ``data`` has every field the commands apply, of the right type: the
    model's dimensions, positive degrees and microbatch counts, a schedule name, a layout string that
    parses for pp × virtual stages and the model's layers, and one device name per rank (or none: the
    devices in the given order)."""
    from pipewright.models.layout import parse_layout

    model = data.get("model")
    if not isinstance(model, dict) or not all(_positive_int(model.get(d)) for d in _DIMS):
        raise ConfigError(f'{where}: "model" must give positive integers {", ".join(_DIMS)}')
    _check_architecture(model, where)
    bad = [k for k in _POSITIVE if not _positive_int(data.get(k, 1 if k == "virtual" else None))]
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)} must be positive integers")
    if not isinstance(data.get("schedule"), str) or not data["schedule"]:
        raise ConfigError(f'{where}: "schedule" must be a schedule name')
    if not isinstance(data.get("layout"), str):
        raise ConfigError(f'{where}: "layout" must be a layout string such as "Et*2|t*2L"')
    stages = data["pp"] * data.get("virtual", 1)
    parse_layout(data["layout"]).check(model["layers"], stages)
    devices = data.get("devices")
    ranks = data["tp"] * data["pp"] * data["dp"] * data.get("cp", 1)
    if (
        not isinstance(devices, list)
        or len(devices) not in (0, ranks)
        or not all(isinstance(d, str) for d in devices)
    ):
        raise ConfigError(
            f'{where}: "devices" must list one device name for each of the {ranks} ranks (or none)'
        )
    order = data.get("rank_order", DEFAULT_ORDER)
    if order != DEFAULT_ORDER:
        raise ConfigError(
            f'{where}: "rank_order" must be "{DEFAULT_ORDER}" (the order "placement" lists ranks in)'
        )
    place = data.get("placement")
    if place is not None and (
        not isinstance(place, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in place)
        or sorted(place) != list(range(ranks))
    ):
        raise ConfigError(
            f'{where}: "placement" must list each device index 0…{ranks - 1} once (the device of each rank)'
        )
    padded = model.get("padded_vocab")
    if padded is not None and (not _positive_int(padded) or padded < model["vocab"] or padded % data["tp"]):
        raise ConfigError(
            f'{where}: "model.padded_vocab" must be an integer at least "vocab" and divisible by tp'
        )
    if data.get("grad_reduce", GRAD_REDUCE_PLANNED) not in ("after", "overlap"):
        raise ConfigError(f'{where}: "grad_reduce" must be "after" or "overlap"')
    for key in ("schedule_csv", "recompute", "dtype"):
        if key in data and data[key] is not None and not isinstance(data[key], str):
            raise ConfigError(f'{where}: "{key}" must be a string')
    for key in FRAMEWORK_INPUTS:
        if data.get(key) is not None and data[key] not in (choices := _choices(key)):
            raise ConfigError(f'{where}: "{key}" must be one of {", ".join(choices)} (got {data[key]!r})')
    _check_recompute_method(data, where)
    overlap = data.get("tp_comm_overlap")
    if not (overlap is None or isinstance(overlap, bool) or overlap in tuple(tp_overlap_modes())):
        named = ", ".join(tp_overlap_modes())
        raise ConfigError(f'{where}: "tp_comm_overlap" must be one of {named} (or true/false)')
    group = data.get("microbatch_group")
    if group is not None and (not _positive_int(group) or group < data["pp"]):
        raise ConfigError(f'{where}: "microbatch_group" must be an integer at least pp ({data["pp"]})')
    if not isinstance(data.get("sequence_parallel", False), bool):
        raise ConfigError(f'{where}: "sequence_parallel" must be true or false')


#: The architecture fields' types (where a plan records them): field → (check, what it must be).
_ARCH_TYPES = {
    "family": (lambda v: v in ("gpt", "llama", "bert"), '"gpt", "llama" or "bert"'),
    "tied_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "rope_theta": (lambda v: _number(v) and v > 0, "a positive number"),
    "attention_kind": (lambda v: isinstance(v, str), "a string"),
    "mtp_depth": (lambda v: _count(v), "an integer at least 0"),
    "moe_experts": (lambda v: _count(v), "an integer at least 0"),
    "moe_top_k": (lambda v: _positive_int(v), "a positive integer"),
    "moe_shared_experts": (lambda v: _count(v), "an integer at least 0"),
    "moe_ffn_hidden": (lambda v: _count(v), "an integer at least 0"),
    "moe_dense_layers": (lambda v: _count(v), "an integer at least 0"),
    "moe_capacity": (lambda v: _number(v) and v >= 0, "a number at least 0"),
    "moe_aux_loss_coeff": (lambda v: _number(v) and v >= 0, "a number at least 0"),
    "moe_z_loss_coeff": (lambda v: _number(v) and v >= 0, "a number at least 0"),
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_architecture(model: dict[str, Any], where: str) -> None:
    """One-line ConfigError for an architecture field (:data:`ARCH_FIELDS`, the ``moe_*`` fields) of
    the wrong type."""
    for key, (ok, what) in _ARCH_TYPES.items():
        if key in model and not ok(model[key]):
            raise ConfigError(f'{where}: "model.{key}" must be {what} (got {model[key]!r})')


def _check_recompute_method(data: dict[str, Any], where: str) -> None:
    """``recompute_method``/``recompute_num_layers`` (Megatron-LM's;
    :mod:`pipewright.cost.partial_recompute`): uniform or block and a positive integer, on a plan that
    recomputes fully (on some stage, with per-stage modes)."""
    method, count = data.get("recompute_method"), data.get("recompute_num_layers")
    if method is None and count is None:
        return
    from pipewright.cost.partial_recompute import RECOMPUTE_METHODS

    if method not in RECOMPUTE_METHODS or not _positive_int(count if count is not None else 1):
        raise ConfigError(
            f'{where}: "recompute_method" must be one of {", ".join(RECOMPUTE_METHODS)} with '
            '"recompute_num_layers" a positive integer'
        )
    modes = data.get("recompute_per_stage") or [data.get("recompute", "none")]
    if "full" not in modes:
        raise ConfigError(f'{where}: "recompute_method" applies to a plan with "recompute": "full"')
