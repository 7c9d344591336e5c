"""``pipewright check --hf-model``: the pipelined run against ``transformers``' own model as well.

Dropout is disabled for the comparison (every ``*dropout*`` / ``*pdrop*`` field of config.json set to 0
in a copy the runs read; the report names them): with it, two correct runs differ by their random masks.

Against ``transformers`` (:func:`transformers_rows`), in this process, fp32:

- step "logits": the first global batch through ``transformers``' forward (``model(input_ids).logits``)
  and through pipewright's stage modules of the same model in one process; max |Δ| / max |logits|, and
  the loss of each by ``transformers``' own loss function (``model.loss_function`` with the batch's
  targets as ``shift_labels``), plus c · aux where it adds the router loss (its ``aux_loss`` output;
  pipewright's from models/hf/router_loss.py);
- steps 0…n−1: the ``transformers`` model trained through its own forward with the trainer's optimizer,
  learning rate and clipping on the run's global batches, one microbatch at a time (gradients
  accumulated, as the pipeline; the router loss is per microbatch), compared with the pipelined run per
  step as ``check`` compares two runs (loss, gradient norm, parameters;
  :func:`pipewright.cli.check.compare`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: config.json fields that are dropout probabilities (GPT-2's *_pdrop, the others' *dropout*).
_DROPOUT_MARKS = ("dropout", "pdrop")


def without_dropout(source: str, folder: Path) -> tuple[str, list[str]]:
    """``source`` (an ``--hf-model`` folder or config) with every dropout probability 0: a copy of the
    config in ``folder`` beside links to the weights, and the fields changed ("name 0.1"); ``source``
    itself when none is set."""
    from pipewright.models.hf.build import WEIGHT_FILES, config_file

    file = config_file(source)
    data = json.loads(file.read_text())
    changed = [
        f"{k} {v:g}"
        for k, v in data.items()
        if any(m in k for m in _DROPOUT_MARKS)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and v
    ]
    if not changed:
        return source, []
    folder.mkdir(parents=True, exist_ok=True)
    for key in [c.split()[0] for c in changed]:
        data[key] = 0.0
    (folder / "config.json").write_text(json.dumps(data))
    names = set(WEIGHT_FILES)
    index = file.parent / "model.safetensors.index.json"
    if index.is_file():
        names |= set(json.loads(index.read_text()).get("weight_map", {}).values())
    for name in names:
        if (file.parent / name).is_file():
            (folder / name).symlink_to((file.parent / name).resolve())
    return str(folder), changed


def transformers_rows(config: Any) -> tuple[dict, list[dict]]:
    """The first-batch comparison (``logits``: relative max difference, ``loss``/``loss_ours``) and the
    per-step records of the ``transformers`` model trained in this process (names: pipewright's stage
    parameter names, as the pipelined run reports them)."""
    import torch

    from pipewright.data import open_dataset
    from pipewright.models.hf import full_model, read_spec
    from pipewright.models.hf.build import stage_from_model
    from pipewright.models.hf.router_loss import ATTRIBUTE
    from pipewright.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr

    c = config
    spec = read_spec(c.hf_model, seq_len=c.seq_len)
    dataset = open_dataset(c.data, tokenizer=c.tokenizer, progress=False)

    def batch(step: int):
        x, y = dataset.batch("train", step, c.global_batch, spec.seq_len, c.seed)
        return torch.from_numpy(x), torch.from_numpy(y)

    def ce(model, logits, y):
        return model.loss_function(logits, None, vocab_size=logits.shape[-1], shift_labels=y.contiguous())

    def hf_loss(model, out, y):
        """transformers' loss of its output ``out``: its loss function, plus c · aux where it computes
        the router loss (``output_router_logits``)."""
        aux = getattr(out, "aux_loss", None)
        base = ce(model, out.logits, y)
        return base if aux is None else base + model.config.router_aux_loss_coef * aux

    def our_loss(model, logits, y):
        aux = getattr(logits, ATTRIBUTE, None)
        return ce(model, logits, y) if aux is None else ce(model, logits, y) + aux

    model = full_model(c.hf_model, c.seed)
    ours = stage_from_model(full_model(c.hf_model, c.seed), None, 0, 1)
    x, y = batch(0)
    with torch.no_grad():
        out, got = model(input_ids=x), ours(x)
        want = out.logits
        first = {
            "logits": float((want - got).abs().max() / want.abs().max().clamp_min(1e-30)),
            "loss": float(hf_loss(model, out, y)),
            "loss_ours": float(our_loss(model, got, y)),
        }
    # pipewright's names; a parameter its stages leave out keeps the model's name (and counts as missing)
    ours_named = {id(p): n for n, p in stage_from_model(model, None, 0, 1).named_parameters()}
    named = [(ours_named.get(id(p), n), p) for n, p in model.named_parameters()]
    params = [p for _, p in named]
    opt = build_optimizer(c.optimizer, named, lr=c.lr, weight_decay=c.weight_decay)
    rows = []
    for step in range(c.steps):
        x, y = batch(step)
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for xs, ys in zip(x.split(c.microbatch_size), y.split(c.microbatch_size), strict=True):
            part = hf_loss(model, model(input_ids=xs), ys) / (len(x) // c.microbatch_size)
            part.backward()  # per microbatch, as the pipeline (the router loss is per microbatch)
            loss += part.detach()
        set_lr(opt, lr_at(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_ratio=c.min_lr_ratio))
        norm = float(clip_grad_norm_(params, c.grad_clip))
        opt.step()
        stats = {n: param_stats(p) for n, p in named}
        rows.append({"step": step, "loss": float(loss), "grad_norm": norm, "params": stats})
    return first, rows


def first_batch_verdict(first: dict, tol: float) -> str | None:
    """Why the first batch differs from ``transformers`` (None: within ``tol``)."""
    if not first["logits"] <= tol:
        return f"logits differ by {first['logits']:.1e} (relative to the largest, > {tol:g})"
    rel = abs(first["loss_ours"] - first["loss"]) / max(abs(first["loss"]), 1e-12)
    if not (rel <= tol and math.isfinite(first["loss_ours"])):
        return (
            f"loss {first['loss_ours']:.6g} vs {first['loss']:.6g} (relative difference {rel:.1e} > {tol:g})"
        )
    return None


def param_stats(p: Any) -> tuple[float, float, float]:
    """‖θ‖, w·θ and ‖w‖ of a parameter, w = linspace(−1, 1) (cli/check.py's comparison)."""
    import torch

    flat = p.detach().double().flatten()
    w = torch.linspace(-1.0, 1.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return float(flat.norm()), float((flat * w).sum()), float(w.norm())
