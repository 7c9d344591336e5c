"""What a RunSpec gives the cost models of ``pipewright simulate`` and ``pipewright plan`` besides its
model (:func:`pipewright.runspec.model_spec.model_spec`, the one ``train`` builds): the framework's
inputs (its defaults where the spec leaves one unset), the tensor-parallel overlap priced, the
framework's calibration, the optimizer sharding. Read from the spec's fields, by path. Pure Python
(numpy and the cost models are imported only when a reader runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipewright.errors import ConfigError
from pipewright.runspec import RunSpec, with_values

if TYPE_CHECKING:
    from pipewright.cost.efficiency import Efficiency
    from pipewright.hardware import Accelerator

#: Where the spec keeps each input a framework may set by default
#: (:data:`pipewright.cost.frameworks.DEFAULTABLE`, by the cost model's name for it).
FRAMEWORK_DEFAULTABLE: dict[str, tuple[str, str]] = {
    "kernels": ("framework", "kernels"),
    "attention_kernel": ("framework", "attention_kernel"),
    "grad_dtype": ("framework", "grad_dtype"),
    "fsdp_grad_sync": ("memory", "fsdp_grad_sync"),
    "stage_outputs": ("memory", "stage_outputs"),
    "cp_comm": ("framework", "cp_comm"),
}


def with_framework_defaults(spec: RunSpec) -> RunSpec:
    """``spec`` with ``framework.name``'s inputs (:attr:`pipewright.cost.frameworks.Framework.defaults`:
    its kernels, gradient dtype, …) where the spec leaves one unset (None); unchanged without a
    framework or for a name not registered (refused when the command prices)."""
    if not spec.framework.name:
        return spec
    from pipewright.cost.frameworks import framework

    try:
        given = framework(spec.framework.name).defaults
    except ConfigError:
        return spec
    unset = {
        path: given[name]
        for name, path in FRAMEWORK_DEFAULTABLE.items()
        if name in given and getattr(getattr(spec, path[0]), path[1]) is None
    }
    return with_values(spec, unset) if unset else spec


def cost_fields(spec: RunSpec) -> dict[str, object]:
    """The cost-model inputs of the framework the spec sets (gradient dtype, kernels, FSDP's gradient
    sync, stage outputs, context-parallel attention), unset ones left out."""
    fw, memory = spec.framework, spec.memory
    given = {
        "grad_dtype": fw.grad_dtype,
        "kernels": fw.kernels,
        "fsdp_grad_sync": memory.fsdp_grad_sync,
        "stage_outputs": memory.stage_outputs,
        "cp_comm": fw.cp_comm,
    }
    return {k: v for k, v in given.items() if v is not None}


def recompute_fields(spec: RunSpec) -> dict[str, object]:
    """Megatron-LM's partial recomputation the spec sets (``memory.recompute_method`` and
    ``recompute_num_layers``), unset ones left out."""
    given = {
        "recompute_method": spec.memory.recompute_method,
        "recompute_num_layers": spec.memory.recompute_num_layers,
    }
    return {k: v for k, v in given.items() if v is not None}


def tp_comm_overlap(spec: RunSpec) -> str:
    """The tensor-parallel overlap mode priced under ``framework.name``
    (:func:`pipewright.cost.frameworks.tp_comm_overlap`): ``none`` when the spec sets none."""
    from pipewright.cost.frameworks import tp_comm_overlap as resolve

    return resolve(spec.framework.tp_comm_overlap, spec.framework.name)


def framework_efficiency(spec: RunSpec, accelerators: Sequence[Accelerator]) -> Efficiency | None:
    """The calibration ``framework.name`` prices on ``accelerators`` (one kind): the accelerator's
    defaults adjusted by the framework's fitted parameters; None for a framework that changes nothing
    (the default ``megatron``). One-line ConfigError for an unknown name or a cluster of mixed kinds."""
    from pipewright.cost.efficiency import default_efficiency
    from pipewright.cost.frameworks import framework

    fw = framework(spec.framework.name)
    if fw.neutral:
        return None
    kinds = {acc.name: acc for acc in accelerators}
    if len(kinds) != 1:
        mixed = ", ".join(kinds)
        raise ConfigError(f"--framework {fw.name} prices one accelerator kind; the cluster has {mixed}")
    return fw.efficiency(default_efficiency(next(iter(kinds.values()))))


def optimizer_sharding(spec: RunSpec) -> str:
    """``zero1`` (``memory.shard_optimizer``), ``fsdp`` (``memory.fsdp``) or ``none``."""
    return "zero1" if spec.memory.shard_optimizer else "fsdp" if spec.memory.fsdp else "none"
