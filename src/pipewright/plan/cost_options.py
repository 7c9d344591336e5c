"""The cost model's options the planner searches or passes through: attention kernel, context
parallelism, optimizer sharding, tensor-parallel communication overlap and a measured calibration.

They reach :func:`pipewright.cost.recompute.make_cost` as keyword arguments named as
:class:`~pipewright.cost.transformer.TransformerCost`'s fields (``attention``, ``cp``,
``optimizer_sharding``, ``tp_comm_overlap``, ``calibration``). A cost model that lacks a field prices
the default of it; asking it for anything else is a one-line error rather than a silent default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from pipewright.errors import ConfigError

#: Optimizer-state sharding over the data-parallel group: none, the distributed optimizer (ZeRO-1),
#: or FSDP (ZeRO-3).
SHARDING_CHOICES = ("none", "zero1", "fsdp")

#: Each option's value when it changes nothing (what a cost model without the field prices).
_NEUTRAL = {
    "attention": "eager",
    "cp": 1,
    "optimizer_sharding": "none",
    "tp_comm_overlap": "none",
    "attention_kernel": None,
}


@functools.cache
def cost_fields() -> frozenset[str]:
    """The option fields the installed cost model knows."""
    from pipewright.cost.transformer import TransformerCost

    return frozenset(f.name for f in fields(TransformerCost) if f.init)


@functools.cache
def _calibration(path: str):
    from pipewright.cost.calibration import load_calibration

    return load_calibration(path)


@dataclass(frozen=True)
class CostOptions:
    """One candidate's cost-model options (hashable: the planner caches its pieces per options)."""

    attention: str = "flash"
    cp: int = 1
    optimizer_sharding: str = "none"
    tp_comm_overlap: bool | str = "none"  # a cost.tp_overlap mode (True: te, False: none)
    calibration: str | None = None  # a ``pipewright profile --calibration`` file
    attention_kernel: str | None = None  # fa2, fa3, cudnn (None: the GPU's usual)
    moe_imbalance: float = 1.0  # expert load imbalance (MoECost; a mixture-of-experts model only)
    fields: tuple[tuple[str, object], ...] = ()  # plan/spec_inputs.cost_fields (grad_dtype, kernels, …)

    def __post_init__(self) -> None:
        from pipewright.cost.tp_overlap import resolve

        object.__setattr__(self, "tp_comm_overlap", resolve(self.tp_comm_overlap))

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``make_cost``: the fields the cost model knows; a non-neutral value of
        one it does not know is a one-line error."""
        known = cost_fields()
        out: dict[str, object] = {}
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if name in known:
                out[name] = value
            elif value != neutral:
                flag = {"optimizer_sharding": "optimizer sharding", "tp_comm_overlap": "tp-comm-overlap"}
                raise ConfigError(
                    f"this cost model does not price {flag.get(name, name)} {value!r} yet; drop the option"
                )
        if self.moe_imbalance != 1.0:
            out["moe_imbalance"] = self.moe_imbalance
        for name, value in self.fields:
            if name not in known:
                raise ConfigError(f"this cost model does not price {name} {value!r} yet; drop the option")
            out[name] = value
        if self.calibration is not None:
            if "calibration" not in known:
                raise ConfigError("this cost model does not read --calibration yet; drop the option")
            out["calibration"] = _calibration(self.calibration)
        return out


#: --recompute choices of the planner, from the least memory kept to the most (the order
#: :func:`pipewright.plan.refine.per_stage_recompute` lightens a stage in)
RECOMPUTE_ORDER = ("none", "selective", "op", "full")


def check_recompute(modes: tuple[str, ...], spec, attention: str) -> None:
    """One-line errors for --recompute: an unknown mode, or ``op`` (torchtitan's operator-level policy,
    :mod:`pipewright.cost.op_recompute`) where it is not priced: a mixture of experts, eager attention."""
    for mode in modes:
        if mode not in RECOMPUTE_ORDER:
            raise ConfigError(f"--recompute takes {', '.join(RECOMPUTE_ORDER)} (got {mode!r})")
    if "op" in modes and spec.is_moe:
        raise ConfigError("--recompute op prices dense layers only; drop op for a mixture of experts")
    if "op" in modes and attention != "flash":
        raise ConfigError("--recompute op keeps SDPA's output: it needs --attention flash")


def searchable_sharding(requested: tuple[str, ...]) -> tuple[str, ...]:
    """The sharding choices to search: ``requested``, or only "none" where the cost model cannot price
    sharded state (then asking for more is an error)."""
    for mode in requested:
        if mode not in SHARDING_CHOICES:
            raise ConfigError(f"--optimizer-sharding takes {', '.join(SHARDING_CHOICES)} (got {mode!r})")
    if "optimizer_sharding" in cost_fields():
        return requested
    if set(requested) - {"none"}:
        return ("none",)
    return requested


def cp_choices(n: int, seq_len: int, fixed: int | None, max_cp: int) -> tuple[int, ...]:
    """Context-parallel sizes to try: ``fixed``, else the powers of two up to ``max_cp`` that divide the
    device count and split the sequence into 2·cp chunks (ring attention's load-balanced halves, as
    Megatron-LM requires); only 1 where the cost model has no cp."""
    if fixed is not None:
        if seq_len % (2 * fixed) and fixed > 1:
            raise ConfigError(f"--cp {fixed} does not divide the sequence ({seq_len}) into 2·cp chunks")
        if fixed > 1 and "cp" not in cost_fields():
            raise ConfigError("this cost model does not price context parallelism yet; drop --cp")
        return (fixed,)
    if "cp" not in cost_fields():
        return (1,)
    out, cp = [], 1
    while cp <= max_cp:
        if n % cp == 0 and (cp == 1 or seq_len % (2 * cp) == 0):
            out.append(cp)
        cp *= 2
    return tuple(out)
