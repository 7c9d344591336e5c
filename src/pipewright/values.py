"""Checks of values a user gives, shared by the command line and config files: range checks of
numbers, and the type of each value people write in files (:func:`check_types`).

One rule per option (:class:`Limit`), one message per kind of mistake, so ``--lr inf`` on the command
line and ``lr = inf`` in a TOML file are refused with the same line before any work starts; a value of
the wrong type in a TOML file is a one-line error naming the key instead of a traceback later.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipewright.errors import ConfigError


@dataclass(frozen=True)
class Limit:
    """``low`` ≤ value (or ``low`` < value when ``strict``), value ≤ ``high``; None: unbounded."""

    low: float | None = None
    high: float | None = None
    strict: bool = False
    unit: str | None = None  # a positive quantity of this unit ("seconds"): the error names it


#: the largest integer any option takes (what torch, numpy and the C libraries below them hold)
INT_MAX = 2**63 - 1
#: counts that must be at least one
POSITIVE = Limit(low=1)
#: counts where 0 means "never" / "all"
COUNT = Limit(low=0)
#: a positive real number (rates, seconds)
POSITIVE_REAL = Limit(low=0, strict=True)
#: a positive number of seconds (timeouts)
SECONDS = Limit(low=0, strict=True, unit="seconds")
FRACTION = Limit(low=0, high=1)


def flag_name(name: str) -> str:
    """The command-line spelling of an option (``microbatch_size`` → ``--microbatch-size``)."""
    return "--" + name.removesuffix("_s").replace("_", "-") if not name.startswith("-") else name


def _bound(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def check_value(flag: str, value: object, limit: Limit) -> None:
    """Raise a one-line :class:`ConfigError` when ``value`` is not finite or outside ``limit``.
    None (not given) and non-numbers (checked elsewhere) pass."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    shown = f"{value:g}" if isinstance(value, float) else str(value)  # TOML's 1 and the flag's 1.0 alike
    if limit.unit is not None and not (math.isfinite(value) and value > (limit.low or 0)):
        raise ConfigError(f"{flag} must be a positive number of {limit.unit} (got {shown})")
    if not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number (got {shown})")
    if limit.low is not None:
        if limit.strict and not value > limit.low:
            bound = "positive" if limit.low == 0 else f"greater than {_bound(limit.low)}"
            raise ConfigError(f"{flag} must be {bound} (got {shown})")
        if not limit.strict and value < limit.low:
            raise ConfigError(f"{flag} must be at least {_bound(limit.low)} (got {shown})")
    high = limit.high if limit.high is not None else (INT_MAX if isinstance(value, int) else None)
    if high is not None and value > high:
        raise ConfigError(f"{flag} must be at most {_bound(high)} (got {shown})")


def check_values(values: Mapping[str, object], limits: Mapping[str, Limit]) -> None:
    """:func:`check_value` for every named limit; option names as dataclass fields or dests."""
    for name, limit in limits.items():
        if name in values:
            check_value(flag_name(name), values[name], limit)


def check_finite(values: Mapping[str, object], names: Iterable[str] | None = None) -> None:
    """Every float among ``values`` (or those ``names``) must be finite: NaN/inf are never a setting."""
    for name in values if names is None else names:
        value = values.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_name(name)} must be a finite number (got {value})")


#: the numbers of ``pipewright train`` (TrainConfig fields), command line and TOML alike
TRAIN_LIMITS: dict[str, Limit] = {
    **{
        n: POSITIVE
        for n in (
            "tp",
            "pp",
            "dp",
            "virtual",
            "microbatches",
            "microbatch_size",
            "steps",
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "ffn_hidden",
            "vocab",
            "seq_len",
            "stop_after",
            "eval_batches",
            "cp",
            "ep",
            "moe_top_k",
            "moe_ffn_hidden",
        )
    },
    **{
        n: COUNT
        for n in (
            "checkpoint_every",
            "eval_every",
            "warmup",
            "keep_checkpoints",
            "max_restarts",
            "moe_experts",  # 0: dense
            "moe_shared_experts",
            "moe_dense_layers",
            "moe_capacity",  # 0: dropless
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
        )
    },
    # sizes past these build structures of ~10⁸ entries before any memory estimate can run
    "layers": Limit(low=1, high=100_000),
    "pp": Limit(low=1, high=100_000),
    "virtual": Limit(low=1, high=1_000),
    "seq_len": Limit(low=1, high=10_000_000),
    "vocab": Limit(low=1, high=100_000_000),
    "seed": Limit(low=0, high=2**63 - 1),
    "lr": POSITIVE_REAL,
    "min_lr_ratio": FRACTION,
    "weight_decay": COUNT,
    "grad_clip": COUNT,  # 0 disables clipping
    "recv_timeout_s": SECONDS,
    "collective_timeout_s": SECONDS,
}


#: the largest schedule ``train`` builds (3·p·v·m actions): a million microbatch passes per step
MAX_TRAIN_ACTIONS = 2_000_000


def train_warnings(steps: int, warmup: int, stop_after: int | None, lr: float) -> list[str]:
    """Settings that are legal but do not do what they say: one line each, naming the flags."""
    notes = []
    if warmup >= steps and warmup > 0:
        notes.append(
            f"--warmup {warmup} is not below --steps {steps}: the learning rate never reaches --lr {lr:g}"
        )
    if stop_after is not None and stop_after > steps:
        notes.append(f"--stop-after {stop_after} is beyond --steps {steps}: the run ends at step {steps}")
    return notes


def check_train(config: object) -> list[str]:
    """A TrainConfig's numbers: non-finite or out-of-range values raise (:data:`TRAIN_LIMITS`); returns
    the warnings of :func:`train_warnings`."""
    values = config.flat() if hasattr(config, "flat") else vars(config)  # feature options included
    if values.get("on_save_error", "stop") not in ("stop", "retry", "skip"):
        raise ConfigError(f"--on-save-error {values['on_save_error']!r}: choose one of stop, retry, skip")
    check_values(values, TRAIN_LIMITS)  # before check_finite: a limit's own line for NaN (timeouts)
    check_finite(values)
    actions = 3 * values["pp"] * (values["virtual"] or 1) * values["microbatches"]
    if actions > MAX_TRAIN_ACTIONS:
        raise ConfigError(
            f"--pp {values['pp']} × --microbatches {values['microbatches']} make a schedule of about "
            f"{actions:,} actions, more than {MAX_TRAIN_ACTIONS:,}; use fewer microbatches (a larger "
            "--microbatch-size) or fewer stages"
        )
    fields = getattr(type(config), "__dataclass_fields__", {})
    default = fields["warmup"].default if "warmup" in fields else None
    warmup = 0 if values["warmup"] == default else values["warmup"]  # the default is no one's choice: no note
    return train_warnings(values["steps"], warmup, values["stop_after"], values["lr"])


#: How :func:`check_types` names a type it wanted.
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _accepts(kind: type, value: object) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def check_types(cls: type, values: Mapping[str, object], source: str) -> None:
    """Raise a one-line ConfigError for the first ``values`` entry (field name → value) whose type is not
    the dataclass field's (``X | None`` also takes no value: TOML has no null). NaN/inf and
    ranges: :class:`Limit` (the same lines as on the command line)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints[name]
        kinds = (
            [a for a in typing.get_args(hint) if a is not type(None)]
            if isinstance(hint, types.UnionType)
            else [hint]
        )
        if not any(_accepts(k, value) for k in kinds):
            want = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(f"{source}: {name} must be {want}, not {shown}")
