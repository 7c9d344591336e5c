"""RunSpec sections. How the step runs: schedule, batch, precision, memory and framework. Each field is
declared once (:func:`~pipewright.runspec.fields.spec_field`): type, default, flag, help, the commands
that take it. Pure Python.
"""

from __future__ import annotations

from pipewright.runspec.choices import (
    Attention,
    AttentionKernel,
    CpComm,
    CpuAllocator,
    FsdpGradSync,
    GradDtype,
    GradReduce,
    Kernels,
    Precision,
    Recompute,
    RecomputeMethod,
    StageOutputs,
)
from pipewright.runspec.fields import PRICING, SCHEDULE, TRAINING, section, spec_field, variant_of_each


@section
class ScheduleSection:
    """The pipeline schedule and its generator's settings (``[schedule]``)."""

    name: str | None = spec_field(
        "1f1b",
        "--schedule",
        "schedule name or PyTorch schedule CSV",
        commands=("simulate", "train", "check", *SCHEDULE),
        variants={
            "simulate": {
                "default": None,
                "help": "schedule name (`pipewright schedule list`) or CSV file",
            },
            **variant_of_each(SCHEDULE, default=None, positional="NAME", help="schedule name"),
        },
    )
    microbatch_group: int | None = spec_field(
        None,
        "--microbatch-group",
        (
            "interleaved-1f1b: microbatches N that pass through each chunk together (p ≤ N ≤ "
            "m: Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage, Llama 3 "
            "§3.3.2; default p)"
        ),
        commands=PRICING,
        minimum=1,
    )
    zb_memory_limit: float | None = spec_field(
        None,
        "--zb-memory-limit",
        "zb-auto: at most this many microbatches in flight per rank (default 2p − 1)",
        commands=("simulate",),
    )
    zb_refine: bool = spec_field(
        False,
        "--zb-refine",
        (
            "zb-auto: refine the heuristic's order with the paper's integer linear program "
            "(scipy; pip install 'pipewright[ilp]'); kept only where it is faster"
        ),
        commands=(*PRICING, *SCHEDULE),
    )
    zb_ilp_time_limit: float | None = spec_field(
        None,
        "--zb-ilp-time-limit",
        "zb-auto: seconds the refinement may solve for (implies --zb-refine; default 10)",
        commands=(*PRICING, *SCHEDULE),
    )


@section
class BatchSection:
    """Microbatches and batch sizes (``[batch]``)."""

    microbatches: int | None = spec_field(
        4,
        "--microbatches",
        "microbatches per data-parallel replica",
        commands=("simulate", "train", "check", *SCHEDULE),
        minimum=1,
        variants={
            "simulate": {
                "default": None,
                "help": "microbatches per iteration m (unit costs)",
                "aliases": ("-m",),
            },
            **variant_of_each(SCHEDULE, default=None, help="microbatches m", aliases=("-m",)),
        },
    )
    microbatch_size: int | None = spec_field(
        8,
        "--microbatch-size",
        "sequences per microbatch",
        commands=("simulate", "train", "check"),
        minimum=1,
        variants={"simulate": {"default": None, "help": "sequences per microbatch (default 1)"}},
    )
    global_batch_size: int | None = spec_field(
        None,
        "--global-batch-size",
        "sequences per iteration over all data-parallel replicas (microbatches = it ÷ (b × dp))",
        commands=(*PRICING, *TRAINING),
        minimum=1,
    )


@section
class PrecisionSection:
    """Number formats of compute and reductions (``[precision]``)."""

    dtype: str | None = spec_field(
        None,
        "--dtype",
        "compute dtype",
        commands=("simulate", "plan", "calibrate"),
        variants={"calibrate": {"default": "bf16", "help": "fp16, bf16, fp8, fp32"}},
    )
    precision: Precision = spec_field(
        "fp32",
        "--precision",
        "fp32, bf16 or fp16 (fp32 master weights and optimizer state; fp16 loss scaling)",
        commands=("train", "check", "profile"),
        variants={
            "profile": {
                "help": "the run's compute dtype: the layers and the boundary message are timed in it"
            }
        },
    )
    reduce_fp32: bool = spec_field(
        False,
        "--reduce-fp32",
        "with --precision bf16/fp16: sum data-parallel gradients in fp32",
        commands=TRAINING,
    )


@section
class MemorySection:
    """Activation recomputation, state sharding and what stays in memory (``[memory]``)."""

    recompute: Recompute = spec_field(
        "none",
        "--recompute",
        "activation recomputation: full (the layer input kept), selective (the attention core re-run), op "
        "(torchtitan's operator-level policy: every second matmul and the memory-bound ops re-run), none",
        commands=("simulate", "train", "check", "calibrate"),
    )
    recompute_method: RecomputeMethod | None = spec_field(
        None,
        "--recompute-method",
        (
            "with --recompute full, Megatron-LM's --recompute-method: uniform (groups of N "
            "layers, only each group's input kept, the whole group re-run) or block (the "
            "first N layers of each chunk recomputed, the rest keep their activations)"
        ),
        commands=PRICING,
    )
    recompute_num_layers: int | None = spec_field(
        None,
        "--recompute-num-layers",
        "N for --recompute-method (1 ≤ N ≤ layers of the largest chunk; default 1)",
        commands=PRICING,
    )
    fsdp_grad_sync: FsdpGradSync | None = spec_field(
        None,
        "--fsdp-grad-sync",
        (
            "with --fsdp and --pp > 1: gradients reduce-scattered every microbatch (sharded; "
            "the default) or once per step (held unsharded until then: "
            "torch.distributed.pipelining with FSDP2)"
        ),
        commands=PRICING,
    )
    stage_outputs: StageOutputs | None = spec_field(
        None,
        "--stage-outputs",
        (
            "each microbatch's stage output after its send: freed (Megatron's deallocation, "
            "Llama 3; the default), kept until its backward (pipewright train) or until the "
            "step ends, with a receive buffer per microbatch (torch.distributed.pipelining, "
            "torchtitan)"
        ),
        commands=PRICING,
    )
    shard_optimizer: bool = spec_field(
        False,
        "--shard-optimizer",
        "ZeRO-1: each data-parallel rank keeps 1/dp of the optimizer state",
        commands=("simulate", "train", "check"),
    )
    fsdp: bool = spec_field(
        False,
        "--fsdp",
        "FSDP / ZeRO-3: weights, gradients and optimizer state sharded",
        commands=("simulate",),
    )
    cpu_allocator: CpuAllocator = spec_field(
        "retain",
        "--cpu-allocator",
        "retain (CPU workers keep freed tensor memory) or system",
        commands=("train", "check", "profile"),
    )


@section
class FrameworkSection:
    """What the run executes on: the framework, its kernels, overlaps, gradient dtype and context-parallel
    implementation (``[framework]``)."""

    attention: Attention | None = spec_field(
        "flash",
        "--attention",
        (
            "flash (fused attention; the default) or eager (the a·s² scores stored, "
            "Megatron-LM 2021); with --plan, the plan's (eager for plans that do not record "
            "it)"
        ),
        commands=("simulate", "plan", "calibrate"),
        variants={"simulate": {"default": None}},
    )
    attention_kernel: AttentionKernel | None = spec_field(
        None,
        "--attention-kernel",
        (
            "the fused attention kernel priced (published speed per GPU; default the GPU's "
            "usual: fa2 on A100, cudnn on H100/H200/H800)"
        ),
        commands=PRICING,
    )
    grad_dtype: GradDtype | None = spec_field(
        None,
        "--grad-dtype",
        (
            "gradient buffer dtype (default fp32, Megatron-LM's; bf16 is Megatron-Core's "
            "grad_reduce_in_fp32=False, NeMo/Megatron-Bridge performance recipes): its memory "
            "and the data-parallel reduction's bytes (fp16 runs reduce in 16 bits, Megatron's "
            "default)"
        ),
        commands=PRICING,
    )
    kernels: Kernels | None = spec_field(
        None,
        "--kernels",
        (
            "memory-bound kernels: fused (Megatron/Transformer Engine; the default), eager "
            "(PyTorch eager: one kernel per operator, fp32 cross-entropy) or compiled "
            "(torch.compile'd blocks, eager loss)"
        ),
        commands=PRICING,
    )
    cp_comm: CpComm | None = spec_field(
        None,
        "--cp-comm",
        (
            "with --cp > 1, the context-parallel attention priced: transformer-engine "
            "(Megatron-LM's p2p ring; the default), pipewright (this package's ring), "
            "torch-allgather / torch-alltoall (PyTorch's context_parallel with that rotate "
            "method, K/V repeated to the query heads as torchtitan calls it; torchtitan's "
            "default: allgather), llama3-allgather (Llama 3: GQA K/V all-gathered, exposed)"
        ),
        commands=PRICING,
    )
    name: str | None = spec_field(
        None,
        "--framework",
        (
            "the training framework priced (pipewright.cost.frameworks: megatron, the "
            "default; torchtitan, llm-foundry, deepspeed-megatron): its default "
            "--kernels/--attention-kernel/--grad-dtype/--fsdp-grad-sync/--stage-outputs/--cp-comm "
            "(flags given win) and its fitted compute factor and per-layer overhead"
        ),
        commands=("simulate", "plan", "calibrate"),
        variants={"calibrate": {"default": "megatron", "help": "the training framework of the runs"}},
    )
    tp_comm_overlap: bool | str = spec_field(
        False,
        "--tp-comm-overlap",
        (
            "tensor-parallel communication overlapped with GEMMs (MODE: none, te, async-tp): "
            "te (Transformer Engine, behind all of a pass's GEMMs), async-tp (PyTorch's "
            "micro-pipeline pass: each collective with the matmul it fuses; the backward's "
            "input-gradient reduce-scatters exposed), none; bare, the --framework's own "
            "(megatron: te, torchtitan: async-tp)"
        ),
        commands=PRICING,
    )
    grad_reduce: GradReduce | None = spec_field(
        None,
        "--grad-reduce",
        (
            "with --dp > 1, the gradient all-reduce: 'after' the pipeline drains "
            "(Megatron-LM's default; the default with --model) or 'overlap'ped with the "
            "remaining backward (pipewright's executor; the default with --profile)"
        ),
        commands=("simulate", "calibrate"),
        variants={"calibrate": {"default": "overlap", "help": "after or overlap"}},
    )
    compile: bool = spec_field(
        False,
        "--compile",
        ("torch.compile each stage's forward (a stage that cannot compile runs eagerly, with a warning)"),
        commands=TRAINING,
    )
