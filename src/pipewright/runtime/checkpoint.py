"""Checkpoints with ``torch.distributed.checkpoint``: model, optimizer state, step, RNG, config.

Layout on disk (``out/checkpoints``)::

    step_K/          one DCP checkpoint (every rank writes its shards; rank 0 the metadata)
    step_K/meta.json {"step": K, "fingerprint": ..., "config": {...}}
    latest           text file naming the newest complete checkpoint ("step_K")

Writing is atomic: all ranks save into ``step_K.tmp``; once every rank is done, rank 0 adds
``meta.json``, renames the folder to ``step_K`` and only then replaces ``latest`` (itself through a
temporary file and ``os.replace``). A crash during a save therefore leaves ``latest`` naming the
previous, complete checkpoint.

Keys are global parameter names (``model/layers.3.attn.qkv.weight``, ``optim/<name>/exp_avg``), so a
checkpoint does not depend on the pipeline layout: a run may resume with another layout or schedule.
Data-parallel replicas hold identical tensors under identical keys, which DCP stores once. The data
position is the step (batches are a function of (seed, step)); RNG states are kept per rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipewright.errors import ConfigError
from pipewright.optim import init_optimizer_state

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"


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
    state[f"rng/rank{rank}"] = torch.get_rng_state()
    return state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    meta: Mapping[str, object],
) -> Path:
    """Save after ``step`` completed steps into ``ckpt_dir/step_K`` atomically (see module docstring).
    Collective: every rank calls it. ``meta`` (JSON) must hold the config ``fingerprint``."""
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = ckpt_dir / f"step_{step}"
    tmp = ckpt_dir / f"step_{step}.tmp"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    _barrier()
    dcp.save(_state_dict(params, optimizer, rank), checkpoint_id=str(tmp))
    _barrier()
    if rank == 0:
        (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=1, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = ckpt_dir / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, ckpt_dir / LATEST)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path if (path / META).is_file() else None


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def load_checkpoint(
    path: str | Path,
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    fingerprint: str,
) -> dict:
    """Load a checkpoint into ``params`` and ``optimizer`` in place; return its meta (with ``step``).

    Raises a one-line ConfigError when the checkpoint belongs to another model (fingerprint mismatch).
    Collective: every rank calls it.
    """
    path = Path(path)
    meta = read_meta(path)
    if meta.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"checkpoint {path} was written for another model ({meta.get('model', '?')}); "
            "resume with the same model dimensions or use a new --out"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    init_optimizer_state(optimizer)
    state = _state_dict(params, optimizer, rank)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: v for k, v in state.items() if k in stored or not k.startswith("rng/")}
    missing = sorted(k for k in state if k not in stored)
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {missing[0]} (+{len(missing) - 1} more); use a new --out")
    dcp.load(state, checkpoint_id=str(path))
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
    if f"rng/rank{rank}" in state:
        torch.set_rng_state(state[f"rng/rank{rank}"])
    return meta
