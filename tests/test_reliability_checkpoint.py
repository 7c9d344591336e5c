"""Checkpoint integrity (single process): an interrupted save is never picked, a truncated or corrupted
newest checkpoint is reported by file name and the previous complete one is used, ``keep`` prunes."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pipewright.errors import ConfigError
from pipewright.models.gpt import build_full
from pipewright.models.spec import ModelSpec
from pipewright.optim import build_optimizer
from pipewright.runtime.checkpointing.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SPEC = ModelSpec("t", layers=2, hidden=16, heads=2, vocab=32, seq_len=8)


@pytest.fixture
def saved(tmp_path):
    """Checkpoints after steps 2, 4 and 6 of one model (an optimizer step between saves)."""
    model = build_full(SPEC, seed=0)
    params = dict(model.named_parameters())
    opt = build_optimizer("sgd", params.items(), lr=0.1)
    weights = {}
    for step in (2, 4, 6):
        for p in params.values():
            p.grad = torch.full_like(p, 0.1 * step)
        opt.step()
        save_checkpoint(tmp_path, step, params, opt, meta={"fingerprint": "f"})
        weights[step] = {n: p.detach().clone() for n, p in params.items()}
    return tmp_path, params, opt, weights


def _shard(path):
    return next(f for f in sorted(path.iterdir()) if f.suffix == ".distcp")


def test_manifest_verifies_and_the_newest_is_resumed(saved):
    ckpt, *_ = saved
    assert [d.name for d in complete_checkpoints(ckpt)] == ["step_2", "step_4", "step_6"]
    files = json.loads((ckpt / "step_6" / "meta.json").read_text())["files"]
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)
    verify_checkpoint(ckpt / "step_6")
    assert resumable_checkpoint(ckpt) == (ckpt / "step_6", [])


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_damaged_newest_falls_back_to_the_previous(saved, damage, caplog):
    ckpt, params, opt, weights = saved
    shard = _shard(ckpt / "step_6")
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (ckpt / "step_6" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(ckpt / "step_6")
    message = str(info.value)
    assert "\n" not in message and str(ckpt / "step_6") in message
    if damage != "meta":
        assert str(shard) in message  # names the file
    found, warnings = resumable_checkpoint(ckpt)
    assert found == ckpt / "step_4"
    assert len(warnings) == 1 and message in warnings[0]
    assert warnings[0].endswith(f"falling back to the previous complete checkpoint {ckpt / 'step_4'}")
    meta = load_checkpoint(found, params, opt, fingerprint="f")
    assert meta["step"] == 4
    for name, p in params.items():
        assert torch.equal(p, weights[4][name]), name


def test_every_checkpoint_damaged_gives_none_and_says_so(saved):
    ckpt, *_ = saved
    for step in (2, 4, 6):
        _shard(ckpt / f"step_{step}").write_bytes(b"")
    found, warnings = resumable_checkpoint(ckpt)
    assert found is None and warnings[-1].endswith("no older complete checkpoint to fall back to")


def test_interrupted_save_is_never_picked(saved):
    ckpt = saved[0]
    # a save of step 8 that died after writing its shards: a .tmp folder, `latest` unchanged
    (ckpt / "step_8.tmp").mkdir()
    _shard(ckpt / "step_6").rename(ckpt / "step_8.tmp" / "__0_0.distcp")
    (ckpt / "step_8.tmp" / ".metadata").write_bytes(b"partial")
    assert latest_checkpoint(ckpt) == ckpt / "step_6"
    assert "step_8.tmp" not in [d.name for d in complete_checkpoints(ckpt)]
    # and a step_8 folder renamed before `latest` moved on (crash between the two) is not newer either
    (ckpt / "step_8.tmp").rename(ckpt / "step_8")
    (ckpt / "step_8" / "meta.json").write_text(json.dumps({"step": 8, "fingerprint": "f"}))
    found, _ = resumable_checkpoint(ckpt)
    assert found == ckpt / "step_4"  # step_6 lost its shard above; step_8 is newer than `latest`
    (ckpt / "latest").write_text("../../etc\n")  # a garbled pointer is ignored, not followed
    assert latest_checkpoint(ckpt) is None


def test_keep_prunes_all_but_the_newest(tmp_path, caplog):
    model = build_full(SPEC, seed=0)
    params = dict(model.named_parameters())
    opt = build_optimizer("sgd", params.items(), lr=0.1)
    caplog.set_level(logging.INFO, logger="pipewright.runtime.checkpointing.checkpoint")
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, params, opt, meta={"fingerprint": "f"}, keep=2)
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["step_3", "step_4"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    assert any("--keep-checkpoints 2" in r.getMessage() for r in caplog.records)


def test_unreadable_shard_without_manifest_is_one_line(saved):
    ckpt, params, opt, _ = saved
    meta_path = ckpt / "step_6" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["files"]  # as written before manifests existed
    meta_path.write_text(json.dumps(meta))
    _shard(ckpt / "step_6").write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt / "step_6", params, opt, fingerprint="f")
    assert "\n" not in str(info.value) and "cannot be read" in str(info.value)


def test_tensor_parallel_shards_are_rebuilt_for_another_tp_size(tmp_path):
    """Saved as two tp shards of a fused 3-block (QKV-like) weight split along dim 0, loaded whole
    (tp = 1) and as shard 1 of 4: both equal the pieces cut from the full tensor, optimizer state too."""
    torch.manual_seed(0)
    full = torch.randn(24, 5)

    def cut(r: int, t: int) -> torch.Tensor:
        return torch.cat([blk.chunk(t, 0)[r] for blk in full.chunk(3, 0)], 0)

    saved = {f"qkv.weight#tp{r}of2": torch.nn.Parameter(cut(r, 2).clone()) for r in range(2)}
    opt = build_optimizer("sgd", saved.items(), lr=0.0, weight_decay=0.0)
    for p in saved.values():
        p.grad = p.detach().clone()  # momentum buffer = the weight itself: checkable after resharding
    opt.step()
    meta = {"fingerprint": "tp2", "model_fingerprint": "m", "tp_shards": {"qkv.weight": [0, 3]}}
    save_checkpoint(tmp_path, 1, saved, opt, meta=meta)
    for name, want in (("qkv.weight", full), ("qkv.weight#tp1of4", cut(1, 4))):
        target = {name: torch.nn.Parameter(torch.zeros_like(want))}
        opt2 = build_optimizer("sgd", target.items(), lr=0.0, weight_decay=0.0)
        with pytest.raises(ConfigError, match="another model"):
            load_checkpoint(tmp_path / "step_1", target, opt2, fingerprint="tp1")
        load_checkpoint(tmp_path / "step_1", target, opt2, fingerprint="tp1", model_fingerprint="m")
        assert torch.equal(target[name], want), name
        assert torch.equal(opt2.state[target[name]]["momentum_buffer"], want), name


def test_resume_with_another_update_rule_is_one_line_naming_both_settings(tmp_path):
    """An AdamW checkpoint (async ``stash``) resumed with SGD, or with the ``nesterov`` policy's NAdam,
    and a NAdam checkpoint resumed with AdamW (which would silently take NAdam's moments): one line
    naming the checkpoint's settings and this run's. A checkpoint without the ``update_rule`` record
    (older) is judged by its stored slots; the same update rule under another policy loads."""
    from pipewright.features.async_weights.policies import nesterov_optimizer

    def trained(kind: str):
        params = dict(build_full(SPEC, seed=0).named_parameters())
        opt = build_optimizer("sgd" if kind == "sgd" else "adamw", params.items(), lr=0.1)
        opt = nesterov_optimizer(opt) if kind == "nadam" else opt
        for p in params.values():
            p.grad = torch.full_like(p, 0.1)
        opt.step()
        return params, opt

    def config(optimizer: str, policy: str) -> dict:
        return {"optimizer": optimizer, "weight_policy": policy, "kfac_base": "adamw"}

    first, adamw = trained("adamw")
    meta = {"fingerprint": "f", "config": config("adamw", "stash")}
    save_checkpoint(tmp_path / "a", 2, first, adamw, meta=meta)
    params, nadam = trained("nadam")
    save_checkpoint(
        tmp_path / "n", 2, params, nadam, meta={"fingerprint": "f", "config": config("adamw", "nesterov")}
    )
    path = tmp_path / "a" / "step_2"
    cases = [
        (
            path,
            "sgd",
            config("sgd", "stash"),
            "--optimizer adamw (AdamW: exp_avg, exp_avg_sq, step) but this run "
            "has --optimizer sgd (SGD: momentum_buffer); resume with --optimizer adamw, or start a new --out",
        ),
        (
            path,
            "nadam",
            config("adamw", "nesterov"),
            "--optimizer adamw --weight-policy stash (AdamW: exp_avg, "
            "exp_avg_sq, step) but this run has --optimizer adamw --weight-policy nesterov (NAdam: exp_avg, "
            "exp_avg_sq, mu_product, step); resume with --optimizer adamw --weight-policy stash",
        ),
        (
            tmp_path / "n" / "step_2",
            "adamw",
            config("adamw", "predict"),
            "holds the optimizer state of "
            "--optimizer adamw --weight-policy nesterov (NAdam: exp_avg, exp_avg_sq, mu_product, step)",
        ),
    ]
    for ckpt, kind, settings, message in cases:
        params, opt = trained(kind)
        with pytest.raises(ConfigError) as info:
            load_checkpoint(ckpt, params, opt, fingerprint="f", settings=settings)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
        assert str(info.value).startswith(f"--resume: checkpoint {ckpt} holds the optimizer state of ")
    record = json.loads((path / "meta.json").read_text())
    assert record["update_rule"] == "AdamW"
    del record["update_rule"]  # as written before the record existed
    (path / "meta.json").write_text(json.dumps(record))
    params, opt = trained("nadam")
    with pytest.raises(ConfigError, match=r"stash \(exp_avg, exp_avg_sq, step\) but this run has"):
        load_checkpoint(path, params, opt, fingerprint="f", settings=config("adamw", "nesterov"))
    params, opt = trained("adamw")  # the same rule under another policy: loads
    load_checkpoint(path, params, opt, fingerprint="f", settings=config("adamw", "predict"))
    for name, p in params.items():
        assert torch.equal(opt.state[p]["exp_avg"], adamw.state[first[name]]["exp_avg"]), name
