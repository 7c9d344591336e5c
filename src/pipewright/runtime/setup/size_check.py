"""What a training layout will need, estimated before any worker starts, so a run that cannot fit this
machine (or whose first stage would outlast the next stage's receive timeout) is refused in one line
instead of computing for minutes and failing as a "hang".

Per pipeline rank r (tp = t, its stages' layers l_r, the schedule's peak microbatches in flight
π_r = :func:`pipewright.ir.peak_in_flight`):

- memory = 16 bytes per parameter (fp32 weights and gradients, AdamW's two moments; mixed precision
  adds a 16-bit copy, counted as 2 more) × (l_r·P_layer + embedding/output V·h on the end stages) / t
  + activations :func:`pipewright.cost.activations.runtime_stage_peak_bytes` (l_r layers, π_r
  microbatches) / t + ``PROCESS_BYTES`` per process (the interpreter and torch);
- forward time of one microbatch on rank r = l_r·F_layer / t / ``CPU_FLOPS`` (F_layer =
  8bsh² + 4bshf + 4bs²h), an optimistic rate, so a refusal is certain: the next stage waits at least
  that long in a receive;
- step time ≈ 3 × (forward FLOPs of the global batch) / (``CPU_FLOPS`` × processes) (backward = 2×
  forward), shown by ``train --dry-run``;
- one checkpoint (:func:`checkpoint_bytes`) = 12 bytes per parameter (fp32 weights, AdamW's two
  moments) + ``ENTRY_BYTES`` per stored tensor (4 per parameter tensor: the weights, two moments, the
  step count) + ``RNG_BYTES`` per process + ``META_BYTES``, with the parameters and their tensors
  counted on copies of the model with its dense layers and one or two more, weights on the meta
  device, extrapolated per layer: the free disk space
  ``--out`` needs, checked with its writability.

On a CPU run every process lives on this machine, so their sum is compared with the available
memory (``MemAvailable``); GPU runs are compared per device elsewhere (not here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipewright.cost.activations import runtime_stage_peak_bytes
from pipewright.cost.transformer import layer_forward_flops, layer_parameters, logit_forward_flops
from pipewright.errors import ConfigError
from pipewright.files import check_writable_folder
from pipewright.ir import peak_in_flight
from pipewright.outputs import size_text

#: an optimistic single-thread CPU rate (FLOP/s): a time estimate from it is a lower bound
CPU_FLOPS = 2e11
#: resident memory of one worker process before its model (Python, torch, gloo)
PROCESS_BYTES = 400 * 2**20
#: what DCP adds per stored tensor: its entry in a ``.distcp`` file (≈1,580 bytes) and in ``.metadata``
#: (≈250); measured on a 2-layer GPT's checkpoint (118 tensors, 1.84 MB), torch 2.13, 2026-12-07
ENTRY_BYTES = 1830
#: a process's CPU random-generator state (5,056 bytes) with its entry
RNG_BYTES = 5056 + ENTRY_BYTES
#: meta.json (the config and the file manifest)
META_BYTES = 4096


@dataclass(frozen=True)
class SizeEstimate:
    rank_bytes: list[float]  # per pipeline rank, per process
    processes: int
    forward_s: list[float]  # one microbatch's forward on each pipeline rank (lower bound)
    step_s: float  # lower bound
    checkpoint_bytes: float  # one checkpoint on disk (:func:`checkpoint_bytes`)

    @property
    def total_bytes(self) -> float:
        per_pp = self.processes // len(self.rank_bytes)
        return sum(self.rank_bytes) * per_pp

    def describe(self) -> str:
        peak = max(self.rank_bytes)
        return (
            f"estimated memory {self.total_bytes / 2**30:.2f} GiB over {self.processes} process(es) "
            f"(up to {peak / 2**30:.2f} GiB per process); a step takes at least {self.step_s:.3g} s; "
            f"a checkpoint takes about {self.checkpoint_bytes / 2**30:.3g} GiB"
        )


def available_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (Linux), else physical memory; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def estimate(run) -> SizeEstimate:
    """:class:`SizeEstimate` of a :class:`~pipewright.runtime.core.trainer.PreparedRun` (see the module
    docstring for the formulas)."""
    c, spec, sched = run.config, run.spec, run.schedule
    counts = run.layout.layer_counts
    t, b = c.tp, c.microbatch_size
    state = 16 + (2 if c.precision != "fp32" else 0)
    element = 4 if c.precision == "fp32" else 2
    peaks = peak_in_flight(sched)
    rank_bytes, forward_s = [], []
    last_stage = sched.num_stages - 1
    for r in range(sched.num_ranks):
        stages = sched.stages_of(r)
        layers = sum(counts[s] for s in stages)
        ends = (0 in stages) + (last_stage in stages)
        params = layers * layer_parameters(spec) + ends * spec.vocab * spec.hidden
        acts = runtime_stage_peak_bytes(
            spec,
            b,
            c.recompute,
            layers=layers,
            in_flight=max(1, int(peaks[r] + 0.999)),
            element_bytes=element,
            last=last_stage in stages,
        )
        rank_bytes.append((state * params + acts) / t + PROCESS_BYTES)
        flops = layers * layer_forward_flops(spec, b) + (last_stage in stages) * logit_forward_flops(spec, b)
        forward_s.append(flops / t / CPU_FLOPS)
    total_fwd = c.global_batch * (spec.layers * layer_forward_flops(spec, 1) + logit_forward_flops(spec, 1))
    step_s = 3 * total_fwd / (CPU_FLOPS * c.world_size)
    return SizeEstimate(rank_bytes, c.world_size, forward_s, step_s, checkpoint_bytes(spec, c.world_size))


def _parameters(spec) -> tuple[int, int]:
    """(elements, tensors) of ``spec``'s whole model: from copies of one and two layers built on the meta
    device (no memory), extrapolated per layer; the layer formula when the family cannot be built so."""
    from dataclasses import replace

    import torch

    from pipewright.models.family import build_full

    class MetaWeights(torch.overrides.TorchFunctionMode):
        """Weights allocated on the meta device (``empty``, ``randn``, ``rand``: no memory) and their
        initialisation skipped (in-place operations such as ``normal_``, scalings of a fresh weight);
        small buffers (RoPE tables) computed as usual: computing on the meta device imports torch's
        compiler (seconds)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name, kwargs = getattr(func, "__name__", ""), kwargs or {}
            if name in ("empty", "randn", "rand"):
                kwargs.pop("generator", None)
                return torch.empty(*args, **{**kwargs, "device": "meta"})
            in_place = name.endswith("_") and not name.endswith("__")
            meta = bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_meta
            if meta and (in_place or name in ("mul", "div", "add", "sub")):
                return args[0]  # same shape (a scalar or broadcast factor, at initialisation)
            if in_place and "tensor" in kwargs:  # torch.nn.init's pass the tensor by keyword
                return kwargs["tensor"]
            return func(*args, **kwargs)

    first = min(spec.layers, spec.moe_dense_layers + 1)  # the dense layers, then one of the repeated kind
    try:
        counts = []
        for layers in (first, first + 1)[: 1 + (spec.layers > first)]:
            with MetaWeights():
                model = build_full(replace(spec, layers=layers))
            params = list(model.parameters())
            counts.append((sum(p.numel() for p in params), len(params)))
    except Exception:  # a family whose builder needs more (files, a device): the formula, no tensor count
        return spec.layers * layer_parameters(spec) + 2 * spec.vocab * spec.hidden, 0
    (e1, t1), (e2, t2) = counts[0], counts[-1]
    return e1 + (spec.layers - first) * (e2 - e1), t1 + (spec.layers - first) * (t2 - t1)


def checkpoint_bytes(spec, processes: int) -> float:
    """Bytes of one checkpoint of ``spec`` written by ``processes`` processes (module docstring)."""
    elements, tensors = _parameters(spec)
    return 12 * elements + 4 * tensors * ENTRY_BYTES + processes * RNG_BYTES + META_BYTES


def check_fits(run, *, cpu: bool) -> SizeEstimate:
    """Refuse (one line) a run whose processes do not fit this machine's available memory (CPU runs), or
    whose one-microbatch forward on some rank outlasts ``--recv-timeout``; returns the estimate."""
    est = estimate(run)
    c = run.config
    # the run folder: writable, with room for one checkpoint (files.py), before any worker starts
    check_writable_folder(run.out_dir, "--out", need_bytes=int(est.checkpoint_bytes))
    if cpu:
        free = available_bytes()
        if free is not None and est.total_bytes > free:
            raise ConfigError(
                f"this layout needs about {size_text(est.total_bytes)} ({est.processes} processes, "
                f"up to {size_text(max(est.rank_bytes))} each; --seq-len {run.spec.seq_len}, "
                f"--microbatch-size {c.microbatch_size}) but {size_text(free)} is available; use a "
                "shorter --seq-len, smaller --microbatch-size, --recompute full or more --pp"
            )
        slowest = max(est.forward_s)
        if slowest > c.recv_timeout_s:
            raise ConfigError(
                f"one microbatch's forward on a pipeline rank takes at least {slowest:.0f} s here, longer "
                f"than --recv-timeout {c.recv_timeout_s:g} s (the next stage's receive would time out); "
                "use a shorter --seq-len or smaller --microbatch-size, or raise --recv-timeout"
            )
    return est
