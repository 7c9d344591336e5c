"""The closed choices of a RunSpec, one named ``Literal`` each: what a mode may be, for the sections'
fields and for code that compares modes (``spec.memory.recompute == "full"`` type-checks against
:data:`Recompute`). tests/test_runspec.py checks that each equals the choices the command line offers.
Pure Python."""

from __future__ import annotations

from typing import Literal

#: Activation recomputation of one run (``memory.recompute``).
Recompute = Literal["full", "selective", "op", "none"]
#: Megatron-LM's --recompute-method with --recompute full.
RecomputeMethod = Literal["uniform", "block"]
#: Attention priced: fused (no stored scores) or eager.
Attention = Literal["flash", "eager"]
#: The fused attention kernel priced.
AttentionKernel = Literal["fa2", "fa3", "cudnn"]
#: The attention block: multi-head, or DeepSeek's multi-head latent attention.
AttentionKind = Literal["mha", "mla"]
#: The MLP's activation.
Mlp = Literal["gelu", "relu2", "swiglu"]
#: When the data-parallel gradient reduction runs.
GradReduce = Literal["after", "overlap"]
#: The gradient buffer's element type.
GradDtype = Literal["fp32", "bf16"]
#: How the memory-bound kernels run.
Kernels = Literal["fused", "eager", "compiled"]
#: When pipelined FSDP reduce-scatters the gradients.
FsdpGradSync = Literal["microbatch", "step"]
#: What a stage does with a microbatch's output after sending it.
StageOutputs = Literal["freed", "kept", "step"]
#: How context-parallel attention exchanges K/V.
CpComm = Literal["transformer-engine", "pipewright", "torch-allgather", "torch-alltoall", "llama3-allgather"]
#: A training run's number format (fp32 master weights and optimizer state).
Precision = Literal["fp32", "bf16", "fp16"]
#: How the CPU workers keep freed tensor memory.
CpuAllocator = Literal["retain", "system"]
#: The trainers a plan exports to.
Trainer = Literal["megatron", "torchtitan"]
#: ``export-plan --to``: every export target (plan/export_text.TARGETS).
ExportTarget = Literal["megatron", "bridge", "torchtitan", "torchtitan-0.3"]
#: ``schedule export --format``: the file formats a schedule is written in.
ScheduleFormat = Literal["torch-csv"]
#: A cost source other than a model or a profile.
CostSource = Literal["unit"]
#: The device ``profile`` measures on.
Device = Literal["cpu", "cuda"]
#: What a NaN/inf loss or gradient does to its step.
OnNonfinite = Literal["stop", "skip"]
#: What a failed checkpoint save does.
OnSaveError = Literal["stop", "retry", "skip"]
