"""The sharded optimizer's gradient reduction (runtime/parallel/zero.py) where the backend lacks a
reduce-scatter: it all-reduces the flat buffer and keeps this rank's slice, says so once, and does
not try the reduce-scatter again; a timeout is not taken for a missing reduce-scatter. The
collectives are stand-ins (one process): two replicas holding the same buffer, so the sum is twice
it. Sharded training against unsharded, and the collectives a
sharded step issues, are tested through the trainer in tests/test_runtime_features.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from pipewright.runtime.parallel import zero


class Done:
    """A finished collective's work handle."""

    def wait(self, timeout=None) -> bool:
        return True


@pytest.mark.parametrize("error", [NotImplementedError, RuntimeError])
def test_reduce_scatter_falls_back_to_all_reduce_once(monkeypatch, caplog, error):
    tried = []

    def no_reduce_scatter(out, buf, group=None, async_op=False):
        tried.append(buf.numel())
        raise error("reduce_scatter is not supported by this backend\nmore detail")

    def all_reduce(buf, group=None, async_op=False):
        buf.mul_(2)  # two replicas with this same buffer
        return Done()

    backend = f"stand-in-{error.__name__}"
    monkeypatch.setattr(dist, "reduce_scatter_single", no_reduce_scatter, raising=False)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(zero, "_NO_REDUCE_SCATTER", set())
    with caplog.at_level(logging.WARNING, logger=zero.__name__):
        for _ in range(2):
            buf = torch.arange(6, dtype=torch.bfloat16)
            out = torch.empty(3, dtype=torch.bfloat16)
            zero.reduce_scatter(out, buf, group=None)
            assert out.tolist() == [6.0, 8.0, 10.0]  # slice 1 of 2 × [0..5]
    assert tried == [6]  # tried once, then the backend is known
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        f"{backend} has no reduce-scatter (reduce_scatter is not supported by this backend); "
        "the sharded optimizer all-reduces the gradients"
    ]


def test_a_timed_out_reduce_scatter_is_not_taken_for_a_missing_one(monkeypatch):
    def timed_out(out, buf, group=None, async_op=False):
        raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")

    monkeypatch.setattr(dist, "reduce_scatter_single", timed_out, raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "stand-in")
    monkeypatch.setattr(zero, "_NO_REDUCE_SCATTER", set())
    with pytest.raises(RuntimeError, match="Timed out"):
        zero.reduce_scatter(torch.empty(2), torch.zeros(4), group=None)
    assert not zero._NO_REDUCE_SCATTER
