"""Every tensor handed to a collective lives on the mesh's device (NCCL takes only CUDA tensors), and
an empty ZeRO-1 shard joins no collective on any dp peer. The collectives are recorded, not run:
the parameters sit on the ``meta`` device, which stands for a CUDA device the CPU-side code must not
replace by the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipewright.optim import clip_grad_norm_, global_grad_norm
from pipewright.runtime.parallel.zero import MasterOptimizer

META = torch.device("meta")


@pytest.fixture
def calls(monkeypatch):
    """(collective, device, dtype, numel) of every collective called; a world of two ranks."""
    seen: list[tuple[str, torch.device, torch.dtype, int]] = []

    def record(name):
        def collective(tensor, *args, **kwargs):
            seen.append((name, tensor.device, tensor.dtype, tensor.numel()))

        return collective

    def gather_into(out, mine, *args, **kwargs):
        seen.append(("all_gather_into_tensor", out.device, out.dtype, out.numel()))
        assert mine.device == out.device and mine.dtype == out.dtype

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", record("all_reduce"))
    monkeypatch.setattr(dist, "all_gather", record("all_gather"))
    monkeypatch.setattr(dist, "all_gather_into_tensor", gather_into)
    return seen


def _params(*shapes, dtype=torch.float32) -> dict[str, nn.Parameter]:
    return {f"p{i}": nn.Parameter(torch.empty(s, device=META, dtype=dtype)) for i, s in enumerate(shapes)}


def test_norm_term_of_a_rank_without_gradients_is_on_its_device(calls) -> None:
    params = list(_params((4, 4), (4,)).values())  # no .grad: an expert-only rank whose experts idled
    global_grad_norm(params, ["pp"])
    with pytest.raises(RuntimeError, match="meta"):  # reading the norm back: past the collective
        clip_grad_norm_(params, 1.0, ["pp"], norm_params=[])  # the norm's parameters may be none
    assert [c[:2] for c in calls] == [("all_reduce", META)] * 2


def test_sharded_norm_without_any_shard_is_on_the_parameters_device(calls) -> None:
    master = MasterOptimizer(_params((4, 4)), "sgd", lr=0.1, weight_decay=0.0, shard=True, dp=2)
    master.flats.clear()  # no shard at all on this rank
    master.grad_norm([], ["tp"])
    assert {c[1] for c in calls} == {META}


def test_empty_zero_shard_lives_on_the_device_and_joins_no_collective(calls) -> None:
    """A stage without 1-D parameters (an embedding-only chunk): its 'rest' shard is empty; it is
    created on the mesh device and skipped by the gathers on every peer alike."""
    master = MasterOptimizer(
        _params((8, 4), (6, 4), dtype=torch.bfloat16), "sgd", lr=0.1, weight_decay=0.0, shard=True, dp=2
    )
    decay, rest = master.flats
    assert not rest.params and rest.master.device == META
    rest.gather_into_params(None)
    rest.gather_grads(None)
    assert calls == []
    decay.gather_into_params(None)
    # one flat buffer of d slices in the parameters' dtype: no fp32 list, no concatenation
    assert calls == [("all_gather_into_tensor", META, torch.bfloat16, 2 * decay.size)]
