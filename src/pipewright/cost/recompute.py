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

:class:`SelectiveCost` adds ``recompute="selective"`` to :class:`~pipewright.cost.transformer.TransformerCost`
without changing that module: it builds each chunk without recomputation and applies
:func:`selective_chunk`. (The one-line hook that would make it native: in ``TransformerCost._build_chunk``,
``if self.recompute == "selective": return selective_chunk(chunk, ...)``, with "selective" in ``RECOMPUTE``.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from pipewright.cost.transformer import DTYPE_BYTES, TransformerCost, _Chunk
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.models.spec import ModelSpec

RECOMPUTE_CHOICES = ("none", "selective", "full")


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


def selective_chunk(chunk: _Chunk, cost: TransformerCost, n_layers: int) -> _Chunk:
    """A chunk costed without recomputation turned into one with selective recomputation: the
    backward (B, and I where split) re-runs the attention core; F stores 5·a·s²·b/t bytes less per
    layer (scaled by the dtype's element size / 2, as TransformerCost does)."""
    spec, b, t = cost.spec, cost.microbatch, cost.mesh.tp
    s, a = spec.seq_len, spec.heads
    scale = DTYPE_BYTES[cost.dtype] / 2
    extra = n_layers * recompute_flops_per_layer(spec, b, "selective") / t
    core = n_layers * 5 * a * s * s * b / t * scale
    redo = cost.efficiency.memory_traffic * core  # softmax and dropout over the scores, once more
    flops = dict(chunk.flops)
    flops[B] += extra
    flops[I] += extra
    traffic = dict(chunk.traffic)
    traffic[B] += redo
    traffic[I] += redo
    memory = dict(chunk.memory)
    memory[F] -= core
    memory[B] += core
    memory[I] += core  # I frees what F stored minus what W frees
    assert memory[W] <= 0
    return replace(
        chunk,
        flops=MappingProxyType(flops),
        traffic=MappingProxyType(traffic),
        memory=MappingProxyType(memory),
    )


@dataclass(frozen=True, eq=False)
class SelectiveCost(TransformerCost):
    """:class:`TransformerCost` with selective activation recomputation (``recompute`` stays "none"
    on the instance; :attr:`recompute_mode` reads "selective")."""

    recompute_mode: str = "selective"

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        chunk = super()._build_chunk(stage, num_stages, layers)
        return selective_chunk(chunk, self, layers[stage])


def make_cost_check(recompute: str) -> None:
    if recompute not in RECOMPUTE_CHOICES:
        raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)} (got {recompute!r})")


@dataclass(frozen=True, eq=False)
class PerStageCost(TransformerCost):
    """:class:`TransformerCost` with a recomputation mode per stage (chunk): ``per_stage[c]`` in
    none/selective/full. Each chunk's table comes from a cost model of that one mode."""

    per_stage: tuple[str, ...] = ()

    def _build_chunk(self, stage: int, num_stages: int, layers: tuple[int, ...]) -> _Chunk:
        if len(self.per_stage) != num_stages:
            raise ConfigError(
                f"{len(self.per_stage)} per-stage recomputation modes for {num_stages} stages; give one each"
            )
        mode = self.per_stage[stage]
        key = ("mode", mode)
        model = self._cache.get(key)
        if model is None:
            kw = {f.name: getattr(self, f.name) for f in fields(TransformerCost) if f.init}
            kw.pop("recompute")
            model = self._cache[key] = make_cost(mode, **kw)
        return model._build_chunk(stage, num_stages, layers)


def make_cost(
    recompute: str = "none",
    cls: type[TransformerCost] | None = None,
    per_stage: tuple[str, ...] | list[str] | None = None,
    **kwargs,
) -> TransformerCost:
    """A cost model of class ``cls`` (default TransformerCost) for ``recompute`` in none/selective/full
    (``kwargs``: its fields), or with ``per_stage`` one mode per stage (chunk). Selective
    recomputation is modelled for TransformerCost only."""
    if per_stage:
        for mode in per_stage:
            make_cost_check(mode)
        if cls not in (None, TransformerCost):
            raise ConfigError(f"per-stage recomputation is not modelled for {cls.__name__} yet")
        return PerStageCost(per_stage=tuple(per_stage), **kwargs)
    make_cost_check(recompute)
    cls = cls or TransformerCost
    if recompute == "selective":
        if cls is not TransformerCost:
            raise ConfigError(
                f"--recompute selective is not modelled for {cls.__name__} yet; use none or full"
            )
        return SelectiveCost(recompute="none", **kwargs)
    return cls(recompute=recompute, **kwargs)
