"""Activation recomputation: none, selective or full (Korthikanti et al. 2022, arXiv 2205.05198).

Activation memory one transformer layer stores for the backward, 16-bit activations, microbatch b,
sequence s, hidden h, heads a, tensor-parallel size t (Korthikanti et al., Table 2):

=============================================  ===========================================
no recomputation, tensor parallel              s·b·h·(10 + 24/t + 5·a·s/(h·t))
no recomputation, tensor + sequence parallel   s·b·h·(34/t + 5·a·s/(h·t))
selective, tensor parallel                     s·b·h·(10 + 24/t)
selective, tensor + sequence parallel          s·b·h·34/t
full                                           2·s·b·h (the layer input; /t with sequence parallel)
=============================================  ===========================================

(t = 1: 34·s·b·h + 5·a·s²·b.) Selective recomputation drops the attention core's 5·a·s²·b/t bytes
(QKᵀ scores, softmax output, dropout mask and dropout output) and re-runs the core in the backward:
its two batched matmuls, 4·b·s²·h FLOPs per layer (/t per device), plus the memory-bound softmax and
dropout over the a·s² scores.

:class:`~pipewright.cost.transformer.TransformerCost` models the three modes natively (with flash
attention there is no score tensor to drop: selective keeps what none keeps, and still re-runs the
core's 4·b·s²·h in the backward, as Megatron-LM's ``checkpoint_core_attention`` does);
:class:`SelectiveCost` and :class:`PerStageCost` (one mode per stage, a plan's; composed with the
spec's cost class) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from typing import ClassVar

from pipewright.cost.transformer import TransformerCost, _Chunk
from pipewright.errors import ConfigError
from pipewright.ir import Action, Schedule
from pipewright.models.spec import ModelSpec

RECOMPUTE_CHOICES = ("none", "selective", "full")
#: recomputation modes priced by their own cost model class (module path, class), searched by the
#: planner when asked (``plan --recompute op``): torchtitan's operator-level selective checkpointing
#: (:mod:`pipewright.cost.op_recompute`)
RECOMPUTE_CLASSES = {"op": ("pipewright.cost.op_recompute", "OpRecomputeCost")}


def activation_bytes_per_layer(
    spec: ModelSpec, b: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Bytes of 16-bit activations one layer stores per microbatch (the table in the module docstring)."""
    s, h, a = spec.seq_len, spec.hidden, spec.heads
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    core = 5 * a * s * s * b / t  # the attention core: scores, softmax, dropout mask and output
    linear = 34 * s * b * h / t if sequence_parallel else s * b * h * (10 + 24 / t)
    if recompute == "selective":
        return linear
    if recompute == "none":
        return linear + core
    raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)} (got {recompute!r})")


def recompute_flops_per_layer(spec: ModelSpec, b: int, recompute: str) -> float:
    """FLOPs the backward re-runs per layer and microbatch (whole layer, not per tp rank): 0, the
    attention core's 4·b·s²·h (selective), or the layer's forward 8bsh² + 4bshf + 4bs²h (full)."""
    s, h, f = spec.seq_len, spec.hidden, spec.ffn_hidden
    if recompute == "selective":
        return 4 * b * s * s * h
    if recompute == "full":
        return 8 * b * s * h * h + 4 * b * s * h * f + 4 * b * s * s * h
    return 0.0


@dataclass(frozen=True, eq=False)
class SelectiveCost(TransformerCost):
    """:class:`TransformerCost` with selective activation recomputation whatever ``recompute`` says
    (kept for callers; ``TransformerCost(recompute="selective")`` is the same model)."""

    recompute_mode: str = "selective"

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", "selective")
        super().__post_init__()


def make_cost_check(recompute: str) -> None:
    if recompute not in RECOMPUTE_CHOICES and recompute not in RECOMPUTE_CLASSES:
        modes = ", ".join((*RECOMPUTE_CHOICES, *RECOMPUTE_CLASSES))
        raise ConfigError(f"--recompute must be one of {modes} (got {recompute!r})")


@dataclass(frozen=True, eq=False)
class PerStageCost(TransformerCost):
    """A recomputation mode per stage (chunk): ``per_stage[c]`` in none/selective/full or a mode of
    :data:`RECOMPUTE_CLASSES`. A mixin: the class priced is :func:`per_stage_class` of the spec's cost
    class (a mixture of experts keeps :class:`~pipewright.cost.moe_cost.MoECost`'s all-to-alls, expert
    gradient groups and expert state sharding). Each chunk's table and each action's time come from a
    cost model of that chunk's one mode (:func:`make_cost`, cached per mode); what does not depend on
    the mode (parameters, their state, messages) is the composed class's own."""

    per_stage: tuple[str, ...] = ()
    #: Megatron-LM's --recompute-method/--recompute-num-layers for the chunks whose mode is full
    #: (:mod:`pipewright.cost.partial_recompute`); None: each layer checkpointed alone
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    #: the class each chunk's one-mode model is (:func:`per_stage_class` sets it; not a field)
    one_mode: ClassVar[type[TransformerCost]] = TransformerCost

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", "none")
        super().__post_init__()

    def model_for(self, stage: int, num_stages: int) -> TransformerCost:
        """The one-mode cost model of chunk ``stage`` (same fields, ``recompute=per_stage[stage]``)."""
        if len(self.per_stage) != num_stages:
            raise ConfigError(
                f"{len(self.per_stage)} per-stage recomputation modes for {num_stages} stages; give one each"
            )
        mode = self.per_stage[stage]
        key = ("mode", mode)
        model = self._cache.get(key)
        if model is None:
            skip = ("per_stage", "recompute")
            if mode != "full" or self.recompute_method is None:
                skip += ("recompute_method", "recompute_num_layers")
            kw = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name not in skip}
            model = self._cache[key] = make_cost(mode, self.one_mode, **kw)  # op: its own class
        return model

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        return self.model_for(stage, num_stages)._build_chunk(stage, num_stages, layers)

    def compute_time(self, action: Action, schedule: Schedule) -> float:
        """The action's time as its chunk's one-mode model prices it (a mode may change more than the
        chunk's table: MoECost's all-to-alls run again under full recomputation)."""
        return self.model_for(action.stage, schedule.num_stages).compute_time(action, schedule)

    def transient_bytes(self, action: Action, schedule: Schedule) -> float:
        """The recomputation transient of the action's chunk under that chunk's one mode."""
        return self.model_for(action.stage, schedule.num_stages).transient_bytes(action, schedule)


def _exposed_comm(self: PerStageCost, action: Action, schedule: Schedule) -> float:
    """The chunk's one-mode model's exposed communication (a class that prices one)."""
    return self.model_for(action.stage, schedule.num_stages).exposed_comm(action, schedule)


@cache
def per_stage_class(cls: type[TransformerCost]) -> type[TransformerCost]:
    """``cls`` with :class:`PerStageCost` in front (one class per ``cls``, kept as an attribute of this
    module so that it pickles by name); its fields are ``cls``'s and ``per_stage``."""
    if issubclass(cls, PerStageCost):
        return cls
    name = f"PerStage{cls.__name__}"
    body: dict[str, object] = {"__module__": __name__, "__doc__": PerStageCost.__doc__, "one_mode": cls}
    if hasattr(cls, "exposed_comm"):
        body["exposed_comm"] = _exposed_comm
    made = dataclass(frozen=True, eq=False)(type(name, (PerStageCost, cls), body))
    globals()[name] = made
    return made


def make_cost(
    recompute: str = "none",
    cls: type[TransformerCost] | None = None,
    per_stage: tuple[str, ...] | list[str] | None = None,
    **kwargs,
) -> TransformerCost:
    """A cost model of class ``cls`` (default: the spec's, :func:`~pipewright.cost.llama.cost_class`)
    for ``recompute`` in none/selective/full, or a mode of :data:`RECOMPUTE_CLASSES` priced by its
    own class (``kwargs``: its fields), or with ``per_stage`` one mode
    per stage (chunk): :func:`per_stage_class` of ``cls``. ``recompute_method``/``recompute_num_layers``
    in ``kwargs`` (with ``recompute="full"``, or a ``per_stage`` with full stages, which take them):
    Megatron-LM's partial recomputation, :func:`~pipewright.cost.partial_recompute.partial_class` of
    ``cls``."""
    if cls is None and kwargs.get("spec") is not None:
        from pipewright.cost.llama import cost_class

        cls = cost_class(kwargs["spec"])
    method, num_layers = kwargs.pop("recompute_method", None), kwargs.pop("recompute_num_layers", None)
    partial = method is not None or num_layers is not None
    if partial:
        from pipewright.cost.partial_recompute import check_partial, partial_class

        check_partial(method, num_layers, "full" if per_stage and "full" in per_stage else recompute)
    if per_stage:
        for mode in per_stage:  # a plan's modes: the ones the planner searches
            make_cost_check(mode)
        if partial:  # for the stages that recompute fully
            kwargs |= {"recompute_method": method, "recompute_num_layers": num_layers or 1}
        return per_stage_class(cls or TransformerCost)(per_stage=tuple(per_stage), **kwargs)
    if partial:
        made = partial_class(cls or TransformerCost)
        return made(recompute_method=method, recompute_num_layers=num_layers or 1, **kwargs)
    make_cost_check(recompute)
    if recompute in RECOMPUTE_CLASSES:
        import importlib

        module, name = RECOMPUTE_CLASSES[recompute]
        return getattr(importlib.import_module(module), name)(**kwargs)
    return (cls or TransformerCost)(recompute=recompute, **kwargs)
