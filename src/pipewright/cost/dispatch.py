"""How a framework launches its kernels: the host-side floor of a pass (small work).

A CUDA stream runs no faster than the host launches its kernels. Each kernel costs the host a dispatch
time δ (the Python module code, the autograd and ATen dispatch of an eager PyTorch operator, the CUDA
launch call); while the GPU work of a pass is longer than the launches, the queue stays ahead and the
host is hidden; when it is shorter, the GPU waits on the host and the pass takes the launches' time:

    pass time = (G^p + H^p)^(1/p),  G the GPU time, H = kernels × δ

a smooth maximum: where G ≫ H or H ≫ G the larger, and where they are close more than either, because
neither side keeps the other's queue full all the time (the launches and the kernels vary in length
around their means). p = :data:`EXPONENT` = 8 was chosen on vTrain's fit half (docs/fidelity.md,
"Ranking", mechanism 10): the least p of 3, 4, 6, 8 that brings every (tp, microbatch) cell of the fit
half within 15 %; p = ∞ (a plain max) left the cells where G ≈ H 10–17 % fast, p = 3 (the earlier
choice) tp 2 microbatch 4 23 % slow. A chunk holding layers and the embedding or the head combines
each piece with its own launches (:func:`chunk_launched`), as the planner does.
(the GPU time is every other term of :meth:`pipewright.cost.transformer.TransformerCost.kind_time`).
The kernels of a pass are the layer's forward kernels in F, its backward kernels (split half and half
between I and W) in the backward, the forward's again where the backward recomputes it (full
recomputation), and one per tensor-parallel collective. The host's side also waits for each
tensor-parallel collective: H = kernels × δ + the collectives' seconds (``waited``; vTrain's
microbatch-1 rows gain about the all-reduces' measured latency per layer with tp, docs/fidelity.md,
"Ranking", mechanism 7). A :class:`Dispatch` model states the kernels
of one layer forward and backward as the framework's code launches them; the framework's entry
(:attr:`pipewright.cost.frameworks.Framework.dispatch`) names the model and gives δ (fitted on measured
runs of the framework, :mod:`pipewright.cost.measured`; 0 where none were measured: the floor is not
priced).

Kernels per dense layer (GPT/Llama block: two norms, four linear layers, attention, activation, two
residual adds), counted from the code each runs:

- ``eager`` (PyTorch eager with an unfused softmax, counted on Megatron-DeepSpeed's
  ``megatron/model/transformer.py`` with its softmax unfused; torchtitan's and llm-foundry's blocks
  without ``torch.compile`` launch about as many): forward 17 — layer norm, QKV GEMM, the score
  ``baddbmm``, scale, mask fill, softmax, dropout, ``bmm``, the context's ``permute().contiguous()``,
  output GEMM, bias-dropout-add (2), layer norm, MLP up GEMM, bias-GeLU, down GEMM, bias-dropout-add;
  backward 45 — two GEMMs per linear layer (8), the bias gradients (4), attention's two ``bmm``
  gradients of each batched product (4), softmax, mask, scale and dropout gradients (4), the norms'
  input and weight gradients (4), GeLU's (1), the residual fan-out sums and dropout-add gradients (6),
  the context permute's (1), and the accumulation of each of the layer's 12 parameter gradients into
  its fp32 main-gradient buffer (Megatron-DeepSpeed's ``fp32 grad accumulation``, 12; other eager
  frameworks do the same once per microbatch through their gradient buckets).
- ``megatron-eager`` (Megatron-DeepSpeed, Megatron-LM before Transformer Engine): ``eager`` with
  Megatron's fused scale-mask-softmax (``FusedScaleMaskSoftmax``: one kernel for scale, mask and
  softmax, one for their gradient): forward 15, backward 43. Where that kernel cannot run
  (:func:`fused_softmax_runs`) Megatron takes the unfused fp32 path, ``softmax_fallback`` = 4 kernels
  more in the forward (cast up, scale, mask, softmax, cast down for the one) and 4 in the backward.
  Its ``loss_bytes`` state Megatron's cross-entropy as its code runs it
  (``vocab_parallel_cross_entropy(output.float(), labels)``, Megatron-DeepSpeed's
  ``megatron/core/tensor_parallel/cross_entropy.py``: the fp32 cast (read 2, write 4 bytes per logit),
  the max (read 4), the subtraction, ``exp`` and division (read and write 4 each), the sum (read 4):
  38 forward; the backward's product with the incoming gradient (read and write 4) and the cast back
  (read 4, write 2): 14), and ``counted_bytes`` that its layers' memory-bound kernels move what each
  kernel reads and writes (:func:`pipewright.cost.kernels.megatron_layer_bytes`) rather than κ × the
  bytes the layer stores.
- ``fused`` (Megatron-Core with Transformer Engine: ``LayerNormLinear``, fused attention, fused
  bias-GeLU and bias-dropout-add): forward 9, backward 20.
- ``compiled`` (``torch.compile`` of each block: the elementwise chains fused by Inductor around the
  GEMMs and the attention kernel): forward 8, backward 18.
- ``graphs`` (CUDA graphs: the pass replayed by one launch): no host floor (δ is not charged).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipewright.cost.shape_scales import scales_of
from pipewright.errors import ConfigError
from pipewright.ir import B, F, I, W
from pipewright.named_registry import Registry


@dataclass(frozen=True)
class Dispatch:
    """One dispatch model (module docstring): ``forward``/``backward`` kernels one layer launches;
    ``replayed``: the pass is one graph launch (no per-kernel host cost)."""

    name: str
    summary: str
    forward: int
    backward: int
    replayed: bool = False
    embedding: tuple[int, int] = (0, 0)
    head: tuple[int, int] = (0, 0)
    collective: int = 1
    softmax_fallback: tuple[int, int] = (0, 0)
    loss_bytes: tuple[float, float] | None = None  # the framework's own cross-entropy, per logit (F, I)
    counted_bytes: bool = False  # its layers' memory-bound bytes counted per kernel (cost/kernels.py)

    def __post_init__(self) -> None:
        if self.forward < 0 or self.backward < 0:
            raise ConfigError(f"dispatch {self.name}: kernel counts must be ≥ 0")

    def layer_kernels(
        self, kind: str, recomputed: bool, collectives: int, softmax_fused: bool = True
    ) -> float:
        """Kernels one layer launches in a ``kind`` pass: F the forward's, I and W half the backward's
        each (I also the recomputed forward's), B both; + its ``collectives`` tensor-parallel calls;
        + :attr:`softmax_fallback` where the fused softmax kernel cannot run (``softmax_fused`` False:
        :func:`fused_softmax_runs`; its backward kernels in I, where the softmax gradient runs)."""
        if self.replayed:
            return 0.0
        fwd, bwd = self.forward, self.backward
        extra = 0 if softmax_fused else self.softmax_fallback[1]
        if not softmax_fused:
            fwd += self.softmax_fallback[0]
        redo = fwd if recomputed else 0
        own = {F: fwd, I: bwd / 2 + extra + redo, W: bwd / 2, B: bwd + extra + redo}
        return own[kind] + collectives


_REGISTRY: Registry[Dispatch] = Registry("dispatch model", "a framework's dispatch")


def register(model: Dispatch, *, override: bool = False) -> Dispatch:
    """Add ``model`` to the registry."""
    return _REGISTRY.add(model.name, model, override=override)


def dispatch(name: str) -> Dispatch:
    """The registered dispatch model ``name``; a one-line ConfigError otherwise."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


register(
    Dispatch(
        "eager",
        "PyTorch eager: every operator its own kernel (module docstring)",
        17,
        45,
        embedding=(4, 6),
        head=(20, 24),
    )
)
register(
    Dispatch(
        "megatron-eager",
        "Megatron-DeepSpeed / Megatron-LM before Transformer Engine: eager PyTorch with Megatron's fused "
        "scale-mask-softmax kernel where it runs (module docstring)",
        15,
        43,
        embedding=(4, 6),
        head=(20, 24),
        softmax_fallback=(4, 4),
        loss_bytes=(38.0, 14.0),
        counted_bytes=True,
    )
)
register(Dispatch("fused", "Megatron-Core with Transformer Engine's fused modules", 9, 20))
register(Dispatch("compiled", "torch.compile'd blocks (Inductor-fused elementwise chains)", 8, 18))
register(Dispatch("graphs", "CUDA graphs: one launch replays the pass", 0, 0, replayed=True))


def fused_softmax_runs(microbatch: int, heads_per_rank: int, seq_len: int, dtype: str) -> bool:
    """Whether Megatron's fused scale-mask-softmax kernel (``FusedScaleMaskSoftmax``, the causal
    ``scaled_upper_triang_masked_softmax``) runs on attention scores of ``microbatch`` × ``heads_per_rank``
    matrices of ``seq_len``²: 16-bit inputs, 16 < s ≤ 2048, s a multiple of 4 and b × heads a
    multiple of 4 (its ``is_kernel_available``: four rows per warp-block); otherwise Megatron runs the
    unfused fp32 path."""
    return (
        dtype in ("fp16", "bf16")
        and 16 < seq_len <= 2048
        and seq_len % 4 == 0
        and (microbatch * heads_per_rank) % 4 == 0
    )


def cost_softmax_fused(cost) -> bool:
    """:func:`fused_softmax_runs` on a :class:`~pipewright.cost.transformer.TransformerCost`'s shape
    (its microbatch, heads per tensor-parallel rank, tokens per context-parallel rank, activations'
    dtype); True with fused (flash) attention, which has no separate softmax."""
    if cost.attention == "flash":
        return True
    heads = max(1, cost.spec.heads // cost.mesh.tp)
    return fused_softmax_runs(cost.microbatch, heads, cost.spec.seq_len // cost.cp, cost.act_dtype)


#: the smooth maximum's exponent p (module docstring)
EXPONENT = 8.0


def combined(gpu: float, host: float) -> float:
    """The pass time of GPU time ``gpu`` launched in ``host`` seconds: (G^p + H^p)^(1/p)."""
    if host <= 0:
        return gpu
    return (gpu**EXPONENT + host**EXPONENT) ** (1 / EXPONENT)


def launched(
    gpu: float,
    efficiency,
    layers: int,
    kind: str,
    recomputed: bool,
    tp_calls: int,
    first: bool = False,
    last: bool = False,
    softmax_fused: bool = True,
    waited: float = 0.0,
) -> float:
    """A ``kind`` pass of ``gpu`` GPU seconds over ``layers`` layers as the host launches it, under
    ``efficiency``'s dispatch model and δ (:attr:`~pipewright.cost.efficiency.Efficiency.host_per_kernel`;
    0: ``gpu`` unchanged): :func:`combined` of it and the launches' H = kernels × δ — the layers'
    kernels, ``tp_calls`` tensor-parallel collectives (each ``collective`` kernels' worth), the
    embedding's (``first``) and the output layer's and loss's (``last``), the unfused softmax's
    where ``softmax_fused`` is False — plus ``waited``, the seconds the host waits for the pass's
    tensor-parallel collectives. The cost model's and the planner's one formula."""
    model = dispatch(efficiency.dispatch)
    if efficiency.host_per_kernel <= 0 or model.replayed:
        return gpu
    kernels = layers * model.layer_kernels(kind, recomputed, 0, softmax_fused) + tp_calls * model.collective
    for held, (fwd, bwd) in ((first, model.embedding), (last, model.head)):
        if held:
            kernels += {F: fwd, I: bwd / 2, W: bwd / 2, B: bwd}[kind]
    return combined(gpu, kernels * efficiency.host_per_kernel + waited)


def chunk_launched(cost, chunk, kind: str, gpu: float, waited: float = 0.0, rank: int = 0) -> float:
    """:func:`launched` for a ``kind`` pass of a :class:`~pipewright.cost.transformer.TransformerCost`'s
    ``chunk`` (its layers, tensor-parallel collectives, embedding and head) of ``gpu`` GPU seconds,
    ``waited`` of them its exposed tensor-parallel collectives. A chunk with layers and an embedding or
    head (``chunk.ends``: those alone, the embedding and the head each a piece) combines each piece with
    its own launches, as the planner prices a stage's pieces (:mod:`pipewright.plan.costs`): the head's
    GPU time does not hide behind the layers' launches (docs/fidelity.md, "Ranking", mechanism 9), nor
    the embedding's behind the head's. A calibration's measured factors of the
    shape (:func:`pipewright.cost.shape_scales.scales_of`) scale the layers' and the ends' seconds."""
    ends = getattr(chunk, "ends", None)
    full, fused = cost.recompute == "full", cost_softmax_fused(cost)
    calls = len(chunk.tp_bytes[kind]) if cost.mesh.tp > 1 else 0
    layers_scale, ends_scale = scales_of(cost)
    if ends is None:
        seconds = launched(
            gpu, cost.efficiency, chunk.layers, kind, full, calls, chunk.first, chunk.last, fused, waited
        )
        return seconds * (layers_scale if chunk.layers else ends_scale)
    tp = cost.mesh.tp > 1
    pieces = [
        (piece, *cost.gpu_time(piece, kind, rank), len(piece.tp_bytes[kind]) if tp else 0) for piece in ends
    ]
    layers = launched(
        gpu - sum(p[1] for p in pieces),
        cost.efficiency,
        chunk.layers,
        kind,
        full,
        calls - sum(p[3] for p in pieces),
        False,
        False,
        fused,
        waited - sum(p[2] for p in pieces),
    )
    alone = sum(
        launched(
            end_gpu, cost.efficiency, 0, kind, full, end_calls, piece.first, piece.last, fused, end_waited
        )
        for piece, end_gpu, end_waited, end_calls in pieces
    )
    return layers_scale * layers + ends_scale * alone


def optimizer_seconds(cost, params: float) -> float:
    """The optimizer step of ``params`` parameters on one device of a
    :class:`~pipewright.cost.transformer.TransformerCost`: params × the efficiency's
    ``optimizer_bytes`` / the memory bandwidth (measured with a calibration), the fp32 state's bytes
    (all but the 16-bit weight's 2) over the replicas sharing it with a sharded optimizer. A fused Adam
    step (Apex ``FusedAdam``, DeepSpeed's): it reads the fp32 weight, gradient and both moments (16
    bytes), writes the weight and moments (12) and the 16-bit copy (2); the loss scaler's overflow
    check and the clipping norm read the gradient twice more (8): 38 bytes per parameter."""
    per_param = cost.efficiency.optimizer_bytes
    if per_param <= 0:
        return 0.0
    if cost.optimizer_sharding != "none":
        per_param = 2.0 + (per_param - 2.0) / (cost.mesh.dp * cost.mesh.cp)
    bandwidth = cost.topology.accelerator(cost.comm.device(0)).memory_bandwidth
    if cost.calibration is not None:
        bandwidth = cost.calibration.memory_bandwidth
    return params * per_param / bandwidth
