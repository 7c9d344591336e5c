"""DCP checkpoints (single process): exact round trip, atomic ``latest``, fingerprint check."""

from __future__ import annotations

import pytest
import torch

from pipewright.errors import ConfigError
from pipewright.models.gpt import build_full, loss_fn
from pipewright.models.spec import ModelSpec
from pipewright.optim import build_optimizer
from pipewright.runtime.checkpointing import checkpoint_host
from pipewright.runtime.checkpointing.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SPEC = ModelSpec("t", layers=2, hidden=16, heads=2, vocab=32, seq_len=8)


def _model_and_optimizer(seed: int, steps: int):
    model = build_full(SPEC, seed=seed)
    params = dict(model.named_parameters())
    opt = build_optimizer("adamw", params.items(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, SPEC.vocab, (2, SPEC.seq_len), generator=gen)
        opt.zero_grad()
        loss_fn(model(x), x).backward()
        opt.step()
    return params, opt


def test_round_trip_and_crash_during_save(tmp_path):
    params, opt = _model_and_optimizer(1, 3)
    save_checkpoint(tmp_path, 3, params, opt, meta={"fingerprint": "f"})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    # a save that died half-way leaves a .tmp folder and does not move `latest`
    (tmp_path / "step_4.tmp").mkdir()
    (tmp_path / "step_4.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"

    other, opt2 = _model_and_optimizer(2, 0)  # other weights, no optimizer state yet
    meta = load_checkpoint(latest_checkpoint(tmp_path), other, opt2, fingerprint="f")
    assert meta["step"] == 3
    for name, p in params.items():
        assert torch.equal(other[name], p), name
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(opt2.state[other[name]][key]), torch.as_tensor(value)), key

    save_checkpoint(tmp_path, 4, params, opt, meta={"fingerprint": "f"})  # replaces the stale .tmp
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4" and not (tmp_path / "step_4.tmp").exists()

    with pytest.raises(ConfigError, match="another model") as info:
        load_checkpoint(tmp_path / "step_4", other, opt2, fingerprint="g")
    assert "\n" not in str(info.value)
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_cuda_random_state_round_trips_and_older_checkpoints_still_load(tmp_path, monkeypatch):
    """Where CUDA is present the device's generator is saved and restored with the CPU's; a
    checkpoint without it (written before, or on CPUs) loads and leaves the device's state alone.
    CUDA's generator is stood in for by a byte tensor."""
    params, opt = _model_and_optimizer(1, 1)
    save_checkpoint(tmp_path / "old", 1, params, opt, meta={"fingerprint": "f"})  # no CUDA here
    device_state = {"now": torch.arange(16, dtype=torch.uint8)}
    generator = (lambda: device_state["now"].clone(), lambda s: device_state.update(now=s.clone()))
    monkeypatch.setattr(checkpoint_host, "_device_rng", lambda: generator)
    save_checkpoint(tmp_path / "new", 1, params, opt, meta={"fingerprint": "f"})
    device_state["now"] = torch.zeros(16, dtype=torch.uint8)
    load_checkpoint(tmp_path / "new" / "step_1", params, opt, fingerprint="f")
    assert torch.equal(device_state["now"], torch.arange(16, dtype=torch.uint8))
    device_state["now"] = torch.ones(16, dtype=torch.uint8)
    load_checkpoint(tmp_path / "old" / "step_1", params, opt, fingerprint="f")
    assert torch.equal(device_state["now"], torch.ones(16, dtype=torch.uint8))
