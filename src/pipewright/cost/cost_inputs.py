"""The values of an analytical cost model that its memory and memory-traffic formulas read.

:mod:`pipewright.cost.chunk_memory` and :mod:`pipewright.cost.kernels` sit below
:class:`~pipewright.cost.transformer.TransformerCost` (it imports them): they take these numbers and
names, which the cost model works out once (:attr:`TransformerCost.cost_inputs
<pipewright.cost.transformer.TransformerCost.cost_inputs>`), rather than calling back into it. What
depends on a schedule (a chunk's layers, a rank's parameters) or on a subclass's own count (a
layer's recomputation transient, a layer's stored bytes) the cost model passes as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pipewright.cost.efficiency import Efficiency
from pipewright.mesh import Mesh
from pipewright.models.layout import Layout
from pipewright.models.spec import ModelSpec

#: bytes of one element of each dtype
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1})
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("eager", "flash")  # eager: the a·s² scores are stored (Korthikanti et al.); flash: fused


@dataclass(frozen=True)
class CostInputs:
    """One cost model's run, as the memory formulas read it (the field names are the cost model's)."""

    spec: ModelSpec
    microbatch: int  #: b, sequences per microbatch
    mesh: Mesh  #: tp, dp (and pp) sizes
    cp: int  #: context-parallel size c
    dtype: str  #: the GEMMs' dtype
    act_dtype: str  #: the activations' dtype (bf16 under fp8 GEMMs)
    activation_bytes_per_element: int  #: e, bytes of one activation element
    recompute: str  #: none, selective or full
    attention: str  #: eager or flash
    sequence_parallel: bool
    kernels: str  #: fused, eager or compiled (cost/kernels.py)
    stage_outputs: str  #: freed, kept or step (cost/chunk_memory.py)
    layout: Sequence[int] | Layout | None  #: layers per chunk, or where the embedding and head sit
    optimizer_sharding: str  #: none, zero1 or fsdp
    grad_dtype: str
    bytes_per_param: float  #: weights, gradients and optimizer state per parameter, unsharded
    fsdp_grad_sync: str
    regathers: bool  #: FSDP re-gathers each layer's weights per microbatch (pp = 1)
    efficiency: Efficiency  #: memory-traffic factor κ and the framework's dispatch model
