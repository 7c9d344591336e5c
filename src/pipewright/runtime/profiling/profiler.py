"""Measure a GPT's per-action costs on this machine: the profile :class:`~pipewright.cost.ProfiledCost` reads.

For each microbatch size b and layer type — ``embedding`` (token + position embedding), ``layer`` (one
transformer layer, :class:`~pipewright.models.gpt.Block`), ``output`` (final LayerNorm, output layer and
the cross-entropy loss) — built from :mod:`pipewright.models.gpt` exactly as the trainer builds them:

- **F**: the forward (for ``output`` including the loss) and **B**: a full backward (input and weight
  gradients), on the layers a schedule without a split backward trains with (``nn.Linear``; with
  tp > 1 the tensor-parallel layers);
- **I**: the backward with weight gradients deferred (:func:`~pipewright.models.wgrad.deferring`),
  **W**: the flush of the deferred weight gradients — the split the zero-bubble schedules run, on
  ``DeferrableLinear`` layers with the same weights;
- **STEP**: the optimizer step over the layer type's parameters with the trainer's global-norm
  clipping (the norm, and the scaling of an active clip);
- F's ``bytes``: the activation memory the forward keeps for its backward (tensors autograd saves);
- **PARAMS** ``bytes``: the layer type's parameter bytes (= its gradient bytes);
- **MESSAGE**: the stage-boundary tensor (b · s · h elements): its bytes, and its one-way time over a
  gloo channel between two local processes: half the round trip of an echo to a receiver that waited
  blocked while the sender computed a layer forward, as in a pipeline; with ``contention`` N > 2,
  processes 2..N-1 compute meanwhile, so the time includes waiting for a core;
- with ``contention`` = N > 0 (CPU): the **contention curve** ``s(n)``, n = 1..N — n processes run the
  same fixed work (``layer`` forward + backward, ``5 · repeats`` times) from one barrier and
  ``s(n) = T(n) / T(1)`` with T the time the last of them finishes (throughput, not a median of
  single runs, which the scheduler's unfairness over short spans would distort). Every n is measured
  twice (n = 1..N, then N..1) and averaged, so a drift of the machine's speed cancels. It is written to
  the header as ``contention=s(1),…,s(N)``; :mod:`pipewright.sim.sharing` runs the ranks of an
  oversubscribed (or bandwidth-bound) host at rate 1 / s(n).

On CUDA (``device="cuda"``) the workers are NCCL ranks, one per GPU: the layers, their inputs and the
boundary message are CUDA tensors in the run's ``precision`` (fp32, bf16 or fp16) and the matrix
products use TF32 exactly as a training process does (torch's default, recorded in the header as
``tf32``); the message is timed between two GPUs over NCCL, each repeat read after a device
synchronize. With a single GPU the message row is the time of a device-to-device copy of the boundary
tensor (header ``message=copy``): a pipeline on one GPU has no link.

Every time is the median of ``repeats`` measurements after ``warmup`` unmeasured ones, taken
round-robin over the layer types of one microbatch size (so each type's samples spread over that
size's whole measurement). The work runs
in spawned worker processes with one CPU thread each (as the training workers): ``workers`` of them
(default ``tp``) run the same measurements at once — in groups of ``tp`` with tensor-parallel layers, as
the trainer's, when tp > 1 — and rank 0 records; so with ``workers`` = the run's process count the
times include the workers' contention for this machine's cores. Then ranks 0 and 1 time the message.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipewright.cost.profiled import (
    LAYER_TYPES,
    MESSAGE,
    PARAMS,
    ProfiledCost,
    ProfileRow,
    write_profile_csv,
)
from pipewright.errors import ConfigError
from pipewright.ir import STEP, B, F, I, W
from pipewright.models.gpt import Block, Embedding, Head, layer_generator, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import (
    AccumulateNow,
    WeightGradStore,
    default_linear_factory,
    deferrable_layers,
    deferring,
    plain_linear_factory,
)
from pipewright.optim import build_optimizer, global_grad_norm, scale_grads_
from pipewright.runtime.core.precision import compute_dtype
from pipewright.runtime.profiling.profile_message import copy_time, message_time
from pipewright.runtime.reliability.timeouts import new_group
from pipewright.runtime.setup.launch import spawn

KINDS = (F, B, I, W, STEP)


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure: ``spec`` at each of ``microbatch_sizes``, ``tp``-way tensor parallel, on
    ``device`` ("cpu" or "cuda"), median of ``repeats`` after ``warmup``."""

    spec: ModelSpec
    microbatch_sizes: tuple[int, ...] = (1,)
    tp: int = 1
    device: str = "cpu"
    repeats: int = 10
    warmup: int = 2
    optimizer: str = "adamw"
    progress: bool = True
    workers: int | None = None
    contention: int = 0
    cpu_allocator: str = "retain"  # as the training workers (runtime/setup/host_memory.py)
    precision: str = "fp32"  # the run's: the layers' and the message's dtype

    @property
    def processes(self) -> int:
        """Worker processes: ``workers`` (default tp) measure at once; at least 2 (the message; on CUDA
        only where there are two GPUs), and ``contention`` for the contention curve."""
        pair = 2 if self.device == "cpu" or torch.cuda.device_count() >= 2 else 1
        return max(pair, self.workers or self.tp, self.contention)

    @property
    def backend(self) -> str:
        """The workers' process group: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    def check(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be at least 1 (got {self.repeats})")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more (got {self.warmup})")
        if not self.microbatch_sizes or min(self.microbatch_sizes) < 1:
            raise ConfigError("--microbatch-size values must be at least 1")
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1 (got {self.tp})")
        if self.workers is not None and (self.workers < 1 or self.workers % self.tp):
            raise ConfigError(f"--workers must be a positive multiple of --tp {self.tp} (got {self.workers})")
        for name in ("heads", "ffn_hidden", "vocab"):
            if getattr(self.spec, name) % self.tp:
                raise ConfigError(f"--{name.replace('_', '-')} is not divisible by --tp {self.tp}")
        if self.contention < 0:
            raise ConfigError(f"--contention must be 0 or more (got {self.contention})")
        if self.contention and self.device != "cpu":
            raise ConfigError("--contention measures CPU cores shared by processes; use it with --device cpu")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device!r})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but CUDA is not available here; use --device cpu")
        compute_dtype(self.precision)  # a one-line error for an unknown precision

    def meta(self) -> dict[str, object]:
        """The profile's ``# key=value`` header: the model dimensions it belongs to and how it was taken."""
        s = self.spec
        return {
            "model": s.name.replace(" ", "_"),
            "layers": s.layers,
            "hidden": s.hidden,
            "heads": s.heads,
            "ffn_hidden": s.ffn_hidden,
            "vocab": s.vocab,
            "seq_len": s.seq_len,
            "tp": self.tp,
            "device": self.device,
            "dtype": self.precision,
            "tf32": _tf32() if self.device == "cuda" else "n/a",
            "threads": 1 if self.device == "cpu" else torch.get_num_threads(),
            "repeats": self.repeats,
            "workers": self.workers or self.tp,
            "optimizer": self.optimizer,
            "cpu_allocator": self.cpu_allocator,
            "torch": torch.__version__.split("+")[0],
        }

    @property
    def steps(self) -> int:
        """Progress-bar steps: one per (microbatch size, layer type), one per message, one per n."""
        return len(self.microbatch_sizes) * (len(LAYER_TYPES) + 1) + self.contention


@contextmanager
def _count_saved_bytes(box: list[int]):
    """Sum the bytes of the distinct tensors autograd saves for backward (the activation memory)."""
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            box[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _layer_module(layer_type: str, spec: ModelSpec, factory) -> nn.Module:
    if layer_type == "embedding":
        return Embedding(spec)
    return Block(spec, factory) if layer_type == "layer" else Head(spec, factory)


class _LayerBench:
    """One layer type's module with its input, target and output gradient, and the measurements.

    ``factory`` builds the layers the split backward runs on (I, W); ``full_factory`` (default: the
    same) the layers a schedule without a split backward trains with — ``nn.Linear`` in the trainer
    (``wgrad.linear_factory_for``) — on which F and B are measured. Both hold the same weights."""

    def __init__(
        self,
        layer_type: str,
        spec: ModelSpec,
        b: int,
        device: torch.device,
        factory,
        loss,
        optimizer: str,
        full_factory=None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layer_type, self.device, self.loss = layer_type, device, loss
        gen = layer_generator(0, layer_type)
        s, h = spec.seq_len, spec.hidden
        self.module = _layer_module(layer_type, spec, factory)
        self.module.reset_parameters(spec, gen)
        self.module.to(device=device, dtype=dtype)  # the run's compute dtype, as the trainer casts
        self.full = self.module
        if full_factory is not None and full_factory is not factory:
            self.full = _layer_module(layer_type, spec, full_factory).to(device=device, dtype=dtype)
            self.full.load_state_dict(self.module.state_dict())
        if layer_type == "embedding":
            self.x = torch.randint(0, spec.vocab, (b, s), generator=gen).to(device)
        else:
            self.x = torch.randn(b, s, h, generator=gen).to(device=device, dtype=dtype)
        self.target = torch.randint(0, spec.vocab, (b, s), generator=gen).to(device)
        self.grad = torch.randn(b, s, h, generator=gen).to(device=device, dtype=dtype)
        self.params = list(self.module.parameters())
        self.optimizer = build_optimizer(optimizer, self.module.named_parameters(), lr=1e-4, weight_decay=0.1)
        self.store = WeightGradStore()
        self.accumulate = AccumulateNow()
        self.layers = deferrable_layers(self.module)
        self.full_layers = deferrable_layers(self.full)
        self.out: torch.Tensor | None = None
        self.samples: dict[str, list[float]] = {k: [] for k in KINDS}

    def forward(self, split: bool = False) -> None:
        """F on the full-backward layers, or (``split``) on the split-backward ones, ahead of an I."""
        x = self.x if self.layer_type == "embedding" else self.x.detach().requires_grad_()
        out = (self.module if split else self.full)(x)
        self.out = self.loss(out, self.target) if self.layer_type == "output" else out

    def backward(self, store: WeightGradStore | None = None) -> None:
        """A full backward as the executor runs it (weight gradients of deferrable layers fused into
        ``.grad``), or with ``store`` the I pass (weight-gradient work handed to the store)."""
        grad = None if self.layer_type == "output" else self.grad
        if store is None:
            with deferring(self.full_layers, self.accumulate, 0):
                torch.autograd.backward(self.out, grad)
        else:
            with deferring(self.layers, store, 0):
                torch.autograd.backward(self.out, grad)
        self.out = None

    def input_backward(self) -> None:
        self.backward(self.store)

    def weight_backward(self) -> None:
        self.store.flush(0)

    def step(self) -> None:
        """The trainer's optimizer step: global-norm clipping (the norm, and the scaling of an active
        clip — here by 1, which costs the same) and the optimizer's update."""
        global_grad_norm(self.params)
        scale_grads_(self.params, 1.0)
        self.optimizer.step()

    def activation_bytes(self) -> int:
        box = [0]
        with _count_saved_bytes(box):
            self.forward()
        self.backward()
        return box[0]

    def sample(self, sync: Callable[[], None], record: bool = True) -> None:
        """One repeat: F, B (full-backward layers), F, I, W (split-backward layers; this F is not
        recorded), STEP in turn, so every kind is sampled over the same stretch of time (on a shared
        machine a burst of load then moves all of them alike instead of one kind's short window)."""
        sequence = (
            (F, self.forward),
            (B, self.backward),
            (None, lambda: self.forward(split=True)),
            (I, self.input_backward),
            (W, self.weight_backward),
            (STEP, self.step),
        )
        for kind, fn in sequence:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if record and kind is not None:
                self.samples[kind].append(time.perf_counter() - t0)

    def rows(self, b: int) -> list[ProfileRow]:
        """F, B, I, W, STEP (medians of the recorded samples) and the PARAMS row."""
        times = {k: statistics.median(v) for k, v in self.samples.items()}
        lt = self.layer_type
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return (
            [ProfileRow(lt, b, F, times[F], float(self.activation_bytes()))]
            + [ProfileRow(lt, b, k, times[k]) for k in (B, I, W, STEP)]
            + [ProfileRow(lt, b, PARAMS, 0.0, float(param_bytes))]
        )


def _cpu_layer(spec: ModelSpec, b: int) -> _LayerBench:
    """A transformer layer on the CPU with ``nn.Linear``: the work the contention curve runs and the
    message timing computes between exchanges."""
    return _LayerBench("layer", spec, b, torch.device("cpu"), plain_linear_factory, loss_fn, "sgd")


def _busy_until_told(bench: _LayerBench, key: str) -> None:
    """Run the layer's forward and backward until rank 0 sets ``key`` in the process group's store
    (the processes the contention curve counts keep computing while ranks 0 and 1 time the message;
    gloo's receive cannot be polled, its completion shows only through a blocking wait)."""
    store = dist.distributed_c10d._get_default_store()
    while not store.check([key]):
        bench.forward()
        bench.backward()


def _contention_curve(rank: int, options: ProfileOptions, bar) -> list[float]:
    """``s(n) = T(n) / T(1)`` for n = 1..options.contention (module docstring); all ranks take part."""
    bench = _cpu_layer(options.spec, options.microbatch_sizes[0])
    work = 5 * options.repeats
    for _ in range(options.warmup):
        bench.forward()
        bench.backward()
    n_max = options.contention
    totals: dict[int, list[float]] = {n: [] for n in range(1, n_max + 1)}
    for order in (range(1, n_max + 1), range(n_max, 0, -1)):
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            if rank < n:
                for _ in range(work):
                    bench.forward()
                    bench.backward()
            elapsed = torch.tensor([time.perf_counter() - t0 if rank < n else 0.0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            totals[n].append(float(elapsed))
            if bar is not None and len(totals[n]) == 2:
                bar.update(1)
    base = statistics.fmean(totals[1])
    return [statistics.fmean(totals[n]) / base for n in range(1, n_max + 1)]


def _worker(rank: int, options: ProfileOptions) -> tuple[list[ProfileRow], dict[str, object]] | None:
    spec, tp = options.spec, options.tp
    device = torch.device("cuda", rank % torch.cuda.device_count()) if options.device == "cuda" else None
    device = device or torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    computing = options.workers or tp
    factory, loss = None, loss_fn
    if tp > 1:
        from pipewright.runtime.parallel.tp import tp_linear_factory

        groups = [new_group(list(range(g, g + tp))) for g in range(0, computing, tp)]
        tp_group = groups[rank // tp]
        factory = tp_linear_factory(tp_group, num_heads=spec.heads)
        loss = factory.cross_entropy
    full_factory = None  # tensor-parallel layers serve both backward forms
    if factory is None:  # as the trainer: nn.Linear without a split backward, DeferrableLinear with one
        factory, full_factory = default_linear_factory, plain_linear_factory
    bar = None
    if rank == 0 and options.progress:
        from tqdm import tqdm

        bar = tqdm(total=options.steps, desc="profile", unit="measurement")
    rows: list[ProfileRow] = []
    if rank < computing:
        torch.manual_seed(0)
        # per microbatch size, round-robin over the layer types: each type's repeats spread over the
        # whole measurement, so a shift of the machine's speed for a second moves every type alike
        # (one size's benches alive at a time bounds the memory)
        rounds = options.warmup + options.repeats
        for b in options.microbatch_sizes:
            benches = [
                _LayerBench(
                    lt, spec, b, device, factory, loss, options.optimizer, full_factory, options.dtype
                )
                for lt in LAYER_TYPES
            ]
            for i in range(rounds):
                for bench in benches:
                    bench.sample(sync, record=i >= options.warmup)
                if bar is not None:
                    bar.update(len(benches) * (i + 1) // rounds - len(benches) * i // rounds)
            for bench in benches:
                rows += bench.rows(b)
            del benches
    dist.barrier()
    # with a contention count, processes 2..N-1 compute while the message is timed (the run's load)
    loaded = range(2, options.contention)
    for b in options.microbatch_sizes:
        elems = b * spec.seq_len * spec.hidden
        # the boundary tensor as the run sends it: on the GPU in its dtype; gloo's on the CPU in fp32
        buf = torch.zeros(elems, device=device, dtype=options.dtype) if device.type == "cuda" else None
        nbytes = float(elems * (buf.element_size() if buf is not None else 4))
        if options.processes == 1:  # one GPU: no link; a device-to-device copy of the tensor
            seconds = copy_time(buf, max(options.repeats, 50), 10, sync)
            rows.append(ProfileRow("layer", b, MESSAGE, seconds, nbytes))
        elif rank < 2:
            # only the sender computes between exchanges (the receiver waits blocked, as in a pipeline)
            computes = rank == 0 and device.type == "cpu"
            between = _cpu_layer(spec, b).forward if computes else (lambda: None)
            seconds = message_time(
                1 - rank, elems, max(options.repeats, 50), 10, rank == 0, between, buf, sync
            )
            if rank == 0:
                rows.append(ProfileRow("layer", b, MESSAGE, seconds, nbytes))
                if loaded:
                    dist.distributed_c10d._get_default_store().set(f"profile-message-{b}", "done")
        elif rank in loaded:
            _busy_until_told(_cpu_layer(spec, b), f"profile-message-{b}")
        if bar is not None:
            bar.update(1)
    meta = options.meta()
    if options.processes == 1:
        meta["message"] = "copy"
    if options.contention:
        curve = _contention_curve(rank, options, bar)
        meta["contention"] = ",".join(f"{x:.4f}" for x in curve)
    if bar is not None:
        bar.close()
    return (rows, meta) if rank == 0 else None


def profile_model(options: ProfileOptions) -> tuple[list[ProfileRow], dict[str, object]]:
    """Run the measurements (module docstring) in ``options.processes`` fresh workers; returns the
    profile rows and metadata (write them with :func:`pipewright.cost.profiled.write_profile_csv`)."""
    options.check()
    results = spawn(
        _worker,
        options.processes,
        (options,),
        backend=options.backend,
        timeout_s=3600,
        cpu_allocator=options.cpu_allocator,
    )
    return results[0]


def _tf32() -> str:
    """Whether CUDA matrix products run in TF32 here ("on"/"off"): torch's setting, which this
    process shares with the training processes (neither changes it)."""
    return "on" if torch.backends.cuda.matmul.allow_tf32 else "off"


def check_profile_matches(meta: dict[str, str], spec: ModelSpec, tp: int, source: str) -> None:
    """Raise a one-line ConfigError when a profile's header names other model dimensions than ``spec``
    (the layer count may differ: times are per layer)."""
    wanted = {
        "hidden": spec.hidden,
        "heads": spec.heads,
        "ffn_hidden": spec.ffn_hidden,
        "vocab": spec.vocab,
        "seq_len": spec.seq_len,
        "tp": tp,
    }
    wrong = [f"{k} {meta[k]} (run: {v})" for k, v in wanted.items() if k in meta and str(v) != meta[k]]
    if wrong:
        raise ConfigError(
            f"profile {source} is for another model: {', '.join(wrong)}; run `pipewright profile` "
            "with this model's options"
        )


def write_profile(path: str | Path, rows: Sequence[ProfileRow], meta: dict[str, object]) -> Path:
    """Write ``rows`` as a profile CSV (or the JSON form for a ``.json`` path)."""
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        text_meta = {k: str(v) for k, v in meta.items()}
        cost = ProfiledCost(tuple(rows), rows[0].microbatch_size, 1, meta=text_meta)
        out.write_text(json.dumps(cost.to_json(), indent=1))
    else:
        out.write_text(write_profile_csv(rows, meta))
    return out
