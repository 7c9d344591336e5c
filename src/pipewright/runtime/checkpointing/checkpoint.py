"""Checkpoints with ``torch.distributed.checkpoint``: model, optimizer state, step, RNG, config.

Layout on disk (``out/checkpoints``)::

    step_K/          one DCP checkpoint (every rank writes its shards; rank 0 the metadata)
    step_K/meta.json {"step": K, "fingerprint": ..., "config": {...}}
    latest           text file naming the newest complete checkpoint ("step_K")

Writing is atomic: all ranks save into ``step_K.tmp``; once every rank is done, rank 0 adds
``meta.json``, renames the folder to ``step_K`` and only then replaces ``latest`` (itself through a
temporary file and ``os.replace``). A crash during a save therefore leaves ``latest`` naming the
previous, complete checkpoint.

Integrity: ``meta.json`` also records every file of the checkpoint with its size and CRC-32
(``files``), computed by rank 0 once all ranks have written. :func:`resumable_checkpoint` verifies
them and, when the newest checkpoint is truncated or corrupted, logs which file is wrong and falls back
to the previous complete checkpoint; ``keep`` > 0 deletes all but the newest ``keep`` complete
checkpoints after each save. ``progress`` (the run guard: hang reports, fault injection) hears each
rank's stage of the save (:data:`SAVE_STAGES`): starting, writing its shards, waiting in DCP's
collective for the other ranks' shards, committing (every rank's shards written, before the rename).

Update rule: ``meta.json`` records the class of the optimizer whose state was saved
(``update_rule``), and a resume refuses, in one line, an optimizer whose per-parameter state slots
differ from the stored ones (AdamW's ``exp_avg``/``exp_avg_sq``/``step`` against SGD's
``momentum_buffer``, or NAdam's extra ``mu_product``): the slots are read from DCP's metadata, so
checkpoints from before the record are checked too.

Extra state: an optimizer that implements :class:`ExtraState` (a feature's optimizer, e.g. K-FAC's
factors and inverses, its interval counters and its refresh in progress) — or the ``extra`` hook a
caller passes (the asynchronous weight policies' state) — adds tensors under ``extra/<its keys>``
with the rest, and chooses what to read back on load.

Keys are global parameter names (``model/layers.3.attn.qkv.weight``, ``optim/<name>/exp_avg``), so a
checkpoint does not depend on the pipeline layout: a run may resume with another layout or schedule.
Data-parallel replicas hold identical tensors under identical keys, which DCP stores once. The data
position is the step (batches are a function of (seed, step)); RNG states are kept per rank (the
CPU's and, with CUDA, the device's), and barriers run on a gloo group: :mod:`.checkpoint_host`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from pipewright.errors import ConfigError
from pipewright.optim import init_optimizer_state
from pipewright.runtime.checkpointing.checkpoint_host import barrier, host_group, rng_sources
from pipewright.runtime.checkpointing.dcp_io import dcp_module, reporting_writer
from pipewright.runtime.checkpointing.reshard import reshard_plan
from pipewright.runtime.checkpointing.save_errors import (
    CheckpointSaveError,
    describe,
    describe_error,
    raise_shared,
    save_failed,
)

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"step_(\d+)")


EXTRA = "extra/"
OPTIM = "optim/"

#: The stages of a save as :func:`save_checkpoint` reports them to ``progress``: key → what a hang
#: report says this rank is doing.
SAVE_STAGES = {
    "start": "starting",
    "write": "writing its shards",
    "wait": "waiting for the other ranks' shards",
    "commit": "committing",
}


class CheckpointError(ConfigError):
    """A checkpoint is missing, truncated or corrupted; the message names the file."""


#: (shape, dtype) of a stored tensor, from the checkpoint's metadata.
StoredSpec = tuple[tuple[int, ...], torch.dtype]


@runtime_checkable
class ExtraState(Protocol):
    """The hook through which an optimizer contributes state beyond its per-parameter slots (a
    feature's optimizer: K-FAC's factors, inverses and counters). Keys are the hook's own, stored as
    ``extra/<key>``: per rank unless the tensors are identical on every rank saving them (DCP keeps
    one copy of a key)."""

    def extra_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors to save (called at every save, on every rank)."""
        ...

    def extra_wanted(self, stored: Mapping[str, StoredSpec]) -> list[str]:
        """Which of the checkpoint's extra keys this rank reads (``stored``: every extra key with its
        shape and dtype). May raise a one-line ConfigError (e.g. a layout it cannot resume onto); the
        verdict must be the same on every rank, as the read that follows is collective."""
        ...

    def load_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from the keys :meth:`extra_wanted` chose (empty when it chose none)."""
        ...


def _state_dict(
    params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in params.items()}
    state: dict[str, torch.Tensor] = {f"model/{n}": p.detach() for n, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                state[f"optim/{names[id(p)]}/{key}"] = tensor
    for suffix, (get, _) in rng_sources().items():
        state[f"rng/rank{rank}{suffix}"] = get()
    return state


def _stored_extra(stored: Mapping[str, object]) -> dict[str, StoredSpec]:
    """{key without ``extra/``: (shape, dtype)} of the checkpoint's extra tensors."""
    out = {}
    for key, md in stored.items():
        if key.startswith(EXTRA) and hasattr(md, "size") and hasattr(md, "properties"):
            out[key[len(EXTRA) :]] = (tuple(md.size), md.properties.dtype)
    return out


def _extra_hook(optimizer: torch.optim.Optimizer, extra: ExtraState | None) -> ExtraState | None:
    """The :class:`ExtraState` hook of a save or load: ``extra``, else the optimizer when it is one."""
    if extra is not None:
        return extra
    return optimizer if isinstance(optimizer, ExtraState) else None


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    meta: Mapping[str, object],
    keep: int = 0,
    progress: Callable[[str], None] | None = None,
    extra: ExtraState | None = None,
) -> Path:
    """Save after ``step`` completed steps into ``ckpt_dir/step_K`` atomically (see module docstring).
    Collective: every rank calls it. ``meta`` (JSON) must hold the config ``fingerprint``.
    ``progress(stage)``: called on every rank at each stage of :data:`SAVE_STAGES`. ``extra``: the
    :class:`ExtraState` hook (default: ``optimizer`` when it is one)."""
    progress = progress or (lambda stage: None)
    progress("start")
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = ckpt_dir / f"step_{step}"
    tmp = ckpt_dir / f"step_{step}.tmp"
    error = None
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        except OSError as exc:
            error = describe_error(exc, rank)
    raise_shared(error, final, host_group())
    state = _state_dict(params, optimizer, rank)
    hook = _extra_hook(optimizer, extra)
    if hook is not None:
        state.update({EXTRA + k: v for k, v in hook.extra_state().items()})
    dcp, CheckpointException = dcp_module()
    try:
        dcp.save(state, checkpoint_id=str(tmp), storage_writer=reporting_writer(tmp, progress))
    except (CheckpointException, OSError) as exc:  # every rank gets it (DCP gathers the ranks' results)
        why = describe(exc, tmp, rank)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(save_failed(final, why)) from None
    barrier()
    progress("commit")
    if rank == 0:
        try:
            _commit(ckpt_dir, tmp, final, step, meta, optimizer)
        except OSError as exc:
            error = describe_error(exc, rank)
            shutil.rmtree(tmp, ignore_errors=True)
    raise_shared(error, final, host_group())
    if rank == 0 and keep > 0:
        prune_checkpoints(ckpt_dir, keep)
    barrier()
    return final


def _commit(ckpt_dir: Path, tmp: Path, final: Path, step: int, meta: Mapping[str, object], optimizer) -> None:
    """Rank 0: meta.json (with the file manifest), then ``step_K.tmp`` → ``step_K`` and ``latest``."""
    record = {"step": step, **meta, "update_rule": type(optimizer).__name__, "files": file_manifest(tmp)}
    (tmp / META).write_text(json.dumps(record, indent=1, default=str))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = ckpt_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, ckpt_dir / LATEST)
    log.info("saved checkpoint %s", final)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_manifest(folder: Path) -> dict[str, list[int]]:
    """{relative file name: [size in bytes, CRC-32]} of every file under ``folder`` but ``meta.json``."""
    return {
        str(f.relative_to(folder)): [f.stat().st_size, _crc32(f)]
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != META
    }


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first file of checkpoint ``path`` that is missing,
    truncated or corrupted (size or CRC-32 differs from ``meta.json``'s manifest), or an unreadable
    ``meta.json``. A checkpoint written before manifests existed is checked for its DCP metadata only."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {META} (an interrupted save)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path / META} is unreadable ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"checkpoint file {path / META} has no integer 'step'")
    files = meta.get("files")
    if not isinstance(files, dict):
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint file {path / '.metadata'} is missing")
        return
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size, crc = expected
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {f} is truncated or grown: {f.stat().st_size} bytes, not {size}"
            )
        if _crc32(f) != crc:
            raise CheckpointError(f"checkpoint file {f} is corrupted (CRC-32 differs from {META})")


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Folders ``step_K`` with a ``meta.json`` (a finished save), oldest first; ``.tmp`` folders of an
    interrupted save never count."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for d in ckpt_dir.iterdir():
        m = _STEP_DIR.fullmatch(d.name)
        if m and d.is_dir() and (d / META).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (and never the one ``latest`` names);
    returns the deleted folders."""
    pointed = latest_checkpoint(ckpt_dir)
    old = [d for d in complete_checkpoints(ckpt_dir)[:-keep] if d != pointed]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
        log.info("deleted old checkpoint %s (--keep-checkpoints %d)", d, keep)
    return old


def resumable_checkpoint(ckpt_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (:func:`verify_checkpoint`), starting from the one ``latest``
    names, then older complete ones; and one warning line per checkpoint skipped, naming the bad file
    and the fallback taken. (None, warnings) when none verifies."""
    candidates = complete_checkpoints(ckpt_dir)
    pointed = latest_checkpoint(ckpt_dir)
    if pointed is not None:  # never anything newer than `latest` (a save that did not finish)
        candidates = [d for d in candidates if _step_of(d) <= _step_of(pointed)]
    warnings: list[str] = []
    chosen = _first_verified(candidates, warnings)
    newest = _step_of(chosen) if chosen is not None else -1
    fallback = f"resuming from {chosen.name}" if chosen is not None else "no checkpoint to resume from"
    root = Path(ckpt_dir)
    steps = sorted(root.iterdir(), key=_step_of) if root.is_dir() else []
    for d in steps:  # a step folder without meta.json: said, never skipped silently
        if _STEP_DIR.fullmatch(d.name) and not (d / META).is_file() and _step_of(d) > newest:
            warnings.append(
                f"checkpoint {d} has no {META} (unfinished save or file removed); skipped, {fallback}"
            )
    return chosen, warnings


def _first_verified(candidates: list[Path], warnings: list[str]) -> Path | None:
    """The newest of ``candidates`` that verifies; a warning line for each one skipped."""
    bad: str | None = None
    for d in reversed(candidates):
        try:
            verify_checkpoint(d)
        except CheckpointError as exc:
            bad = str(exc)
            continue
        if bad is not None:
            warnings.append(f"{bad}; falling back to the previous complete checkpoint {d}")
            bad = None
        return d
    if bad is not None:
        warnings.append(f"{bad}; no older complete checkpoint to fall back to")
    return None


def _step_of(path: Path) -> int:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else -1


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _STEP_DIR.fullmatch(name):
        return None
    path = Path(ckpt_dir) / name
    return path if (path / META).is_file() else None


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def same_model(meta: Mapping, fingerprint: str, model_fingerprint: str | None = None) -> bool:
    """The checkpoint (``meta``) is of this model and tp layout, or of this model at another tp size
    (its ``model_fingerprint``, tp left out, equals ours)."""
    if meta.get("fingerprint") == fingerprint:
        return True
    return model_fingerprint is not None and meta.get("model_fingerprint") == model_fingerprint


def _slots(keys: Iterable[str]) -> set[str]:
    """The per-parameter optimizer slots among checkpoint keys ``optim/<parameter>/<slot>``."""
    return {k.rsplit("/", 1)[1] for k in keys if k.startswith(OPTIM)}


def check_update_rule(
    path: Path,
    meta: Mapping,
    optimizer: torch.optim.Optimizer,
    keys: Iterable[str],
    stored: Iterable[str],
    settings: Mapping[str, object] | None = None,
) -> None:
    """One-line ConfigError when the checkpoint's optimizer slots (in ``stored``, its keys) are not
    this run's (in ``keys``): loading would leave slots unset or fill them from another update rule.
    The message names the checkpoint's settings (its config) and this run's (``settings``: the
    optimizer and the options that choose the update rule): the optimizer, and the others where they
    differ."""
    mine, theirs = _slots(keys), _slots(stored)
    if not mine or not theirs or mine == theirs:
        return
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    now = settings or {}
    names = ["optimizer"] + [k for k in now if k != "optimizer" and k in saved and saved[k] != now[k]]

    def flags(values: Mapping) -> str:
        return " ".join(f"--{k.replace('_', '-')} {values.get(k, '?')}" for k in names)

    rule = meta.get("update_rule")
    raise ConfigError(
        f"--resume: checkpoint {path} holds the optimizer state of {flags(saved)} "
        f"({f'{rule}: ' if rule else ''}{', '.join(sorted(theirs))}) but this run has {flags(now)} "
        f"({type(optimizer).__name__}: {', '.join(sorted(mine))}); resume with {flags(saved)}, "
        "or start a new --out"
    )


def load_checkpoint(
    path: str | Path,
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    fingerprint: str,
    model_fingerprint: str | None = None,
    tp_shards: Mapping[str, list[int]] | None = None,
    settings: Mapping[str, object] | None = None,
    extra: ExtraState | None = None,
) -> dict:
    """Load a checkpoint into ``params`` and ``optimizer`` in place; return its meta (with ``step``).

    A checkpoint of another tensor-parallel size loads when ``model_fingerprint`` (the model's
    fingerprint without tp) matches its ``model_fingerprint``: shards are rebuilt by
    :mod:`pipewright.runtime.checkpointing.reshard` from the ``tp_shards`` layouts (split dim and blocks per
    parameter) of its meta and of ``tp_shards`` (this run's).

    Raises a one-line ConfigError when the checkpoint belongs to another model (fingerprint mismatch)
    or holds another update rule's optimizer state (:func:`check_update_rule`; ``settings``: this
    run's config, for the message). Collective: every rank calls it.
    """
    path = Path(path)
    meta = read_meta(path)
    if not same_model(meta, fingerprint, model_fingerprint):
        raise ConfigError(
            f"checkpoint {path} was written for another model ({meta.get('model', '?')}); "
            "resume with the same model dimensions or use a new --out"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    init_optimizer_state(optimizer)
    state = _state_dict(params, optimizer, rank)
    dcp, CheckpointException = dcp_module()
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path / '.metadata'} cannot be read ({type(exc).__name__})"
        ) from None
    check_update_rule(path, meta, optimizer, state, stored, settings)
    state = {k: v for k, v in state.items() if k in stored or not k.startswith("rng/")}
    missing = sorted(k for k in state if k not in stored)
    temps, fill, unknown = reshard_plan(
        missing, stored, {**(meta.get("tp_shards") or {}), **(tp_shards or {})}
    )
    if unknown:
        raise ConfigError(f"checkpoint {path} lacks {unknown[0]} (+{len(unknown) - 1} more); use a new --out")
    hook = _extra_hook(optimizer, extra)
    extra_read: dict[str, torch.Tensor] = {}
    if hook is not None:  # chosen on every rank before the collective read
        specs = _stored_extra(stored)
        extra_read = {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in hook.extra_wanted(specs)}
    try:
        dcp.load(
            {
                **{k: v for k, v in state.items() if k in stored},
                **temps,
                **{EXTRA + k: v for k, v in extra_read.items()},
            },
            checkpoint_id=str(path),
        )
        fill(state)
    except (Exception, CheckpointException) as exc:  # a bad shard despite the manifest, or no manifest
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({first}); delete it to resume from an older one"
        ) from None
    _restore_optimizer_and_rng(state, params, optimizer, rank)
    if hook is not None:
        hook.load_extra_state(extra_read)
    return meta


def _restore_optimizer_and_rng(
    state: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> None:
    """Copy the loaded optimizer slots into ``optimizer``'s state (scalars as Python numbers) and set
    this rank's random generators from the loaded ``state``."""
    names = {id(p): n for n, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = optimizer.state[p]
            for key in list(slot):
                loaded = state[f"optim/{names[id(p)]}/{key}"]
                if torch.is_tensor(slot[key]):
                    slot[key].copy_(loaded)
                else:
                    slot[key] = loaded.item()
    for suffix, (_, set_state) in rng_sources().items():
        if f"rng/rank{rank}{suffix}" in state:  # absent from older checkpoints, or saved without CUDA
            set_state(state[f"rng/rank{rank}{suffix}"])
