"""K-FAC's state in checkpoints: what :class:`~.runtime.PipelinedKFAC` gives the checkpoint's extra-state
hook (:class:`pipewright.runtime.checkpointing.checkpoint.ExtraState`), and how it is read back.

Two kinds of keys:

- ``kfac/layer/<layer>/{a,b,pi,a_inv,b_inv}``: a covered layer's running factors, π and installed
  inverses, under the layer's global name (its parameters' name, with ``#tp<r>of<t>`` for a
  tensor-parallel shard). Data-parallel replicas hold identical values (the factors are all-reduced,
  the inverses installed at one step), so DCP stores one copy; they do not depend on the pipeline
  layout.
- ``kfac/rank/<layout>/<pp.tp.dp>/…``: this rank's refresh in progress — the curvature sums and their
  counts, the blocked-Cholesky inversions part-done (their working matrix and position), inverses
  finished but not yet installed, the worker's flags and counters (iterations, the start of the
  current refresh, refreshes, measured task times) and the optimizer's step count — plus ``meta`` (the
  JSON of the scalars, as bytes).

Curvature whose captured tensors are still pending is folded into the sums before saving (the same
sums, in the same order, as the bubbles would compute), so activations are never saved. Resuming with
the same layout restores everything: the resumed run continues exactly (bit for bit with
``fill_scale = inf``, where the tasks a bubble runs do not depend on measured times). Resuming onto
another pipeline or data-parallel layout (``<layout>`` differs) keeps the factors and inverses of every
layer (their keys are layout-free) and starts a new refresh; another tensor-parallel size is refused
with a one-line error (the shards' factors are blocks of another partition).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pipewright.errors import ConfigError
from pipewright.features.kfac.factors import PiecewiseInverse

log = logging.getLogger(__name__)

LAYER = "kfac/layer/"
RANK = "kfac/rank/"
_WORKER_FIELDS = (
    "recording",
    "refreshes",
    "tasks_run",
    "waits_filled",
    "unit_s",
    "iterations",
    "_started",
    "_recorded",
    "_start_next",
    "_stepped",
)


@dataclass(frozen=True)
class StateNames:
    """Where this rank's K-FAC state goes: ``layout`` (schedule, stages, microbatches, degrees and the
    stage partition: a resume with another one cannot reuse the refresh in progress), ``rank`` (this
    rank's coordinates) and each covered layer's global name."""

    layout: str
    rank: str
    layers: tuple[str, ...]

    @property
    def rank_prefix(self) -> str:
        return f"{RANK}{self.layout}/{self.rank}/"


def layout_name(schedule: str, stages: int, microbatches: int, degrees: Sequence[int], partition: str) -> str:
    """e.g. ``1f1b.s2.m4.pp2.tp1.dp1.3a5c0e19`` (the last part: CRC-32 of the stage partition)."""
    pp, tp, dp = degrees
    crc = zlib.crc32(partition.encode())
    return f"{schedule}.s{stages}.m{microbatches}.pp{pp}.tp{tp}.dp{dp}.{crc:08x}"


def _tp_base(name: str) -> str:
    return name.partition("#tp")[0]


def save_state(opt, names: StateNames) -> dict[str, torch.Tensor]:
    """The tensors of ``opt`` (a :class:`~.runtime.PipelinedKFAC`) to save, keyed as the module
    docstring says."""
    kfac, worker = opt.kfac, opt.worker
    kfac.run_pending_curvature()
    out: dict[str, torch.Tensor] = {}
    for name, st in zip(names.layers, kfac.layers, strict=True):
        for field, value in (("a", st.a), ("b", st.b), ("a_inv", st.a_inv), ("b_inv", st.b_inv)):
            if value is not None:
                out[f"{LAYER}{name}/{field}"] = value
        if st.a is not None:
            out[f"{LAYER}{name}/pi"] = torch.tensor(st.pi, dtype=torch.float64)
    pre = names.rank_prefix
    for i, st in enumerate(kfac.layers):
        for field, value in (("a_sum", st.a_sum), ("b_sum", st.b_sum)):
            if value is not None:
                out[f"{pre}{i}/{field}"] = value
    jobs = []
    for n, ((i, which), job) in enumerate(worker.jobs.items()):
        out[f"{pre}job{n}/work"] = job.work
        for c, col in enumerate(job._cols):
            out[f"{pre}job{n}/col{c}"] = col
        jobs.append([i, which, job.index, job.panels, job.blocks, len(job._cols)])
    staged = []
    for n, ((i, which), inv) in enumerate(worker.staged.items()):
        out[f"{pre}staged{n}"] = inv
        staged.append([i, which])
    meta = {
        "steps": opt.steps,
        "worker": {f: getattr(worker, f) for f in _WORKER_FIELDS},
        "reduced": sorted(worker.reduced),
        "counts": [[st.a_count, st.b_count] for st in kfac.layers],
        "estimates": [[list(k), v] for k, v in worker.estimates.items()],
        "jobs": jobs,
        "staged": staged,
    }
    out[f"{pre}meta"] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return out


def wanted_keys(names: StateNames, stored: Mapping[str, object]) -> list[str]:
    """The stored keys this rank reads: its layers' factors and inverses, and its refresh in progress
    when the layout is the same. A ConfigError when the layers' factors exist only at another
    tensor-parallel size."""
    layer_keys = [k for k in stored if k.startswith(LAYER)]
    saved_layers = {k[len(LAYER) :].rpartition("/")[0] for k in layer_keys}
    other_tp = {_tp_base(n): n for n in saved_layers}
    for name in names.layers:
        if name not in saved_layers and _tp_base(name) in other_tp:
            theirs, ours = (
                n.partition("#tp")[2].partition("of")[2] or "1" for n in (other_tp[_tp_base(name)], name)
            )
            raise ConfigError(
                f"--resume: the checkpoint's K-FAC factors were computed at --tp {theirs} and are not "
                f"resharded to --tp {ours}; resume K-FAC with --tp {theirs}"
            )
    mine = {f"{LAYER}{n}/" for n in names.layers}
    out = [k for k in layer_keys if k[: k.rindex("/") + 1] in mine]
    own = [k for k in stored if k.startswith(names.rank_prefix)]
    if layer_keys and not own and any(k.startswith(RANK) for k in stored):
        log.warning(
            "--resume onto another layout: K-FAC keeps its factors and inverses; the refresh in progress "
            "restarts"
        )
    return out + own


def load_state(opt, names: StateNames, loaded: Mapping[str, torch.Tensor]) -> None:
    """Restore ``opt`` from the tensors :func:`wanted_keys` chose."""
    kfac, worker = opt.kfac, opt.worker
    for name, st in zip(names.layers, kfac.layers, strict=True):
        key = f"{LAYER}{name}/"
        st.a, st.b = loaded.get(key + "a"), loaded.get(key + "b")
        st.a_inv, st.b_inv = loaded.get(key + "a_inv"), loaded.get(key + "b_inv")
        if key + "pi" in loaded:
            st.pi = float(loaded[key + "pi"])
    pre = names.rank_prefix
    if pre + "meta" not in loaded:
        return  # a new refresh starts (another layout, or a checkpoint without K-FAC state)
    meta = json.loads(bytes(loaded[pre + "meta"].tolist()).decode())
    opt.steps = meta["steps"]
    for f, value in meta["worker"].items():
        setattr(worker, f, value)
    worker._iteration = -1  # the executor counts iterations from 0 again
    worker.reduced = set(meta["reduced"])
    worker.estimates = {tuple(k): v for k, v in meta["estimates"]}
    for i, (st, (a_count, b_count)) in enumerate(zip(kfac.layers, meta["counts"], strict=True)):
        st.a_sum, st.b_sum = loaded.get(f"{pre}{i}/a_sum"), loaded.get(f"{pre}{i}/b_sum")
        st.a_count, st.b_count = a_count, b_count
    worker.jobs = {}
    for n, (i, which, index, panels, blocks, cols) in enumerate(meta["jobs"]):
        job = PiecewiseInverse(loaded[f"{pre}job{n}/work"], 0.0, panels, blocks)
        job.work, job.index = loaded[f"{pre}job{n}/work"], index  # the part-done matrix itself
        job._cols = [loaded[f"{pre}job{n}/col{c}"] for c in range(cols)]
        worker.jobs[(i, which)] = job
    worker.staged = {(i, which): loaded[f"{pre}staged{n}"] for n, (i, which) in enumerate(meta["staged"])}
