"""Measure a GPT's per-action costs on this machine: the profile :class:`~pipewright.cost.ProfiledCost` reads.

For each microbatch size b and layer type — ``embedding`` (token + position embedding), ``layer`` (one
transformer layer, :class:`~pipewright.models.gpt.Block`), ``output`` (final LayerNorm, output layer and
the cross-entropy loss) — built from :mod:`pipewright.models.gpt` exactly as the trainer builds them:

- **F**: the forward (for ``output`` including the loss);
- **B**: a full backward (input and weight gradients);
- **I**: the backward with weight gradients deferred (:func:`~pipewright.runtime.wgrad.defer_weight_grads`),
  **W**: the flush of the deferred weight gradients — the split the zero-bubble schedules run;
- **STEP**: the optimizer step (and gradient-norm computation) over the layer type's parameters;
- F's ``bytes``: the activation memory the forward keeps for its backward (tensors autograd saves);
- **PARAMS** ``bytes``: the layer type's parameter bytes (= its gradient bytes);
- **MESSAGE**: the stage-boundary tensor (b · s · h elements): its bytes, and its one-way time over a
  gloo channel between two local processes (half the median ping-pong round trip).

Every time is the median of ``repeats`` measurements after ``warmup`` unmeasured ones. The work runs
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
from pipewright.optim import build_optimizer
from pipewright.runtime.launch import spawn
from pipewright.runtime.wgrad import WeightGradStore, defer_weight_grads

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

    @property
    def processes(self) -> int:
        """Worker processes that measure at once: ``workers`` (default tp), and at least 2 (the message)."""
        return max(2, self.workers or self.tp)

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
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device!r})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but CUDA is not available here; use --device cpu")

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
            "dtype": "fp32",
            "threads": 1 if self.device == "cpu" else torch.get_num_threads(),
            "repeats": self.repeats,
            "workers": self.workers or self.tp,
            "optimizer": self.optimizer,
            "torch": torch.__version__.split("+")[0],
        }


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


class _LayerBench:
    """One layer type's module with its input, target and output gradient, and the measurements."""

    def __init__(
        self, layer_type: str, spec: ModelSpec, b: int, device: torch.device, factory, loss, optimizer: str
    ) -> None:
        self.layer_type, self.device, self.loss = layer_type, device, loss
        gen = layer_generator(0, layer_type)
        s, h = spec.seq_len, spec.hidden
        if layer_type == "embedding":
            self.module: nn.Module = Embedding(spec)
            self.x = torch.randint(0, spec.vocab, (b, s), generator=gen)
        elif layer_type == "layer":
            self.module = Block(spec, factory)
            self.x = torch.randn(b, s, h, generator=gen)
        else:
            self.module = Head(spec, factory)
            self.x = torch.randn(b, s, h, generator=gen)
        self.module.reset_parameters(spec, gen)
        self.module.to(device)
        self.x = self.x.to(device)
        self.target = torch.randint(0, spec.vocab, (b, s), generator=gen).to(device)
        self.grad = torch.randn(b, s, h, generator=gen).to(device)
        self.params = list(self.module.parameters())
        self.optimizer = build_optimizer(optimizer, self.module.named_parameters(), lr=1e-4, weight_decay=0.1)
        self.store = WeightGradStore()
        self.out: torch.Tensor | None = None

    def forward(self) -> None:
        x = self.x if self.layer_type == "embedding" else self.x.detach().requires_grad_()
        out = self.module(x)
        self.out = self.loss(out, self.target) if self.layer_type == "output" else out

    def backward(self) -> None:
        grad = None if self.layer_type == "output" else self.grad
        torch.autograd.backward(self.out, grad)
        self.out = None

    def input_backward(self) -> None:
        with defer_weight_grads(self.store, self.module, key=0):
            self.backward()

    def weight_backward(self) -> None:
        self.store.flush(0)

    def step(self) -> None:
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))
        self.optimizer.step()

    def activation_bytes(self) -> int:
        box = [0]
        with _count_saved_bytes(box):
            self.forward()
        self.backward()
        return box[0]

    def measure(self, b: int, repeats: int, warmup: int, sync: Callable[[], None]) -> list[ProfileRow]:
        """F, B, I, W, STEP and the PARAMS row. One repeat runs F, B, F, I, W, STEP in turn (two F
        samples per repeat), so every kind is sampled over the same stretch of time: on a shared
        machine a burst of load then moves all of them alike instead of one kind's short window."""
        samples: dict[str, list[float]] = {k: [] for k in KINDS}
        sequence = (
            (F, self.forward),
            (B, self.backward),
            (F, self.forward),
            (I, self.input_backward),
            (W, self.weight_backward),
            (STEP, self.step),
        )
        for i in range(warmup + repeats):
            for kind, fn in sequence:
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i >= warmup:
                    samples[kind].append(time.perf_counter() - t0)
        times = {k: statistics.median(v) for k, v in samples.items()}
        lt = self.layer_type
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return (
            [ProfileRow(lt, b, F, times[F], float(self.activation_bytes()))]
            + [ProfileRow(lt, b, k, times[k]) for k in (B, I, W, STEP)]
            + [ProfileRow(lt, b, PARAMS, 0.0, float(param_bytes))]
        )


def _message_time(peer: int, nbytes_elems: int, repeats: int, warmup: int, first: bool) -> float:
    """Half the median ping-pong round trip of a float32 tensor of ``nbytes_elems`` elements."""
    buf = torch.zeros(nbytes_elems)
    samples = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        if first:
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)
        if i >= warmup:
            samples.append((time.perf_counter() - t0) / 2)
    return statistics.median(samples)


def _worker(rank: int, options: ProfileOptions) -> tuple[list[ProfileRow], dict[str, object]] | None:
    spec, tp = options.spec, options.tp
    device = torch.device("cuda", rank % torch.cuda.device_count()) if options.device == "cuda" else None
    device = device or torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    computing = options.workers or tp
    factory, loss = None, loss_fn
    if tp > 1:
        from pipewright.runtime.tensor_parallel import tp_linear_factory

        groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, computing, tp)]
        tp_group = groups[rank // tp]
        factory = tp_linear_factory(tp_group, num_heads=spec.heads)
        loss = factory.cross_entropy
    if factory is None:
        from pipewright.models.gpt import default_linear_factory

        factory = default_linear_factory
    work = [(b, lt) for b in options.microbatch_sizes for lt in LAYER_TYPES]
    bar = None
    if rank == 0 and options.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work) + len(options.microbatch_sizes), desc="profile", unit="measurement")
    rows: list[ProfileRow] = []
    if rank < computing:
        torch.manual_seed(0)
        for b, lt in work:
            bench = _LayerBench(lt, spec, b, device, factory, loss, options.optimizer)
            rows += bench.measure(b, options.repeats, options.warmup, sync)
            if bar is not None:
                bar.set_postfix(b=b, layer=lt)
                bar.update(1)
    dist.barrier()
    for b in options.microbatch_sizes:
        elems = b * spec.seq_len * spec.hidden
        if rank < 2:
            seconds = _message_time(1 - rank, elems, max(options.repeats, 50), 10, rank == 0)
            rows.append(ProfileRow("layer", b, MESSAGE, seconds, float(elems * 4)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return (rows, options.meta()) if rank == 0 else None


def profile_model(options: ProfileOptions) -> tuple[list[ProfileRow], dict[str, object]]:
    """Run the measurements (module docstring) in ``options.processes`` fresh workers; returns the
    profile rows and metadata (write them with :func:`pipewright.cost.profiled.write_profile_csv`)."""
    options.check()
    results = spawn(_worker, options.processes, (options,), backend="gloo", timeout_s=3600)
    return results[0]


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
