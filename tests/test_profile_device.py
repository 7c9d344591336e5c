"""``pipewright profile --device cuda`` measures what a CUDA run runs, and ``train --compare-sim``
profiles on the run's device: NCCL between the workers, layers and boundary message in the run's
dtype. Checked on the CPU by recording what the profiler hands to its launcher and its collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import plain_linear_factory
from pipewright.runtime.profiling import profiler
from pipewright.runtime.profiling.compare import _profile_in_process
from pipewright.runtime.profiling.profile_message import message_time
from pipewright.runtime.profiling.profiler import ProfileOptions, _LayerBench
from pipewright.runtime.setup.config import TrainConfig

SPEC = ModelSpec("t", layers=2, hidden=16, heads=2, vocab=32, seq_len=8)


@pytest.fixture
def two_gpus(monkeypatch):
    """CUDA reads as present with two devices; the launcher records its call instead of spawning."""
    launches: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def spawn(fn, nprocs, args, **kwargs):
        launches.append({"nprocs": nprocs, "options": args[0], **kwargs})
        return [([], {})]

    monkeypatch.setattr(profiler, "spawn", spawn)
    return launches


def test_cuda_profile_runs_its_workers_over_nccl_in_the_runs_dtype(two_gpus) -> None:
    options = ProfileOptions(SPEC, (1,), device="cuda", precision="bf16", progress=False)
    profiler.profile_model(options)
    (launch,) = two_gpus
    assert launch["backend"] == "nccl" and launch["nprocs"] == 2
    assert options.dtype == torch.bfloat16 and options.meta()["dtype"] == "bf16"
    assert options.meta()["tf32"] in ("on", "off")


def test_compare_sim_profiles_on_the_runs_device(two_gpus) -> None:
    config = TrainConfig(hidden=16, heads=2, layers=2, precision="bf16")
    _profile_in_process(config, SPEC, progress=False)
    (launch,) = two_gpus
    assert launch["options"].device == "cuda" and launch["options"].precision == "bf16"
    assert launch["backend"] == "nccl"


def test_layers_and_message_are_timed_in_the_runs_dtype(monkeypatch) -> None:
    bench = _LayerBench(
        "layer", SPEC, 1, torch.device("cpu"), plain_linear_factory, None, "sgd", dtype=torch.bfloat16
    )
    assert {p.dtype for p in bench.module.parameters()} == {torch.bfloat16}
    bench.forward()
    assert bench.out.dtype == torch.bfloat16 and bench.x.dtype == torch.bfloat16
    sent = []
    monkeypatch.setattr(dist, "send", lambda t, dst: sent.append((t.dtype, t.numel())))
    monkeypatch.setattr(dist, "recv", lambda t, src: None)
    buf = torch.zeros(10, dtype=torch.bfloat16)
    message_time(1, 10, repeats=2, warmup=1, first=True, between=lambda: None, buf=buf)
    assert sent == [(torch.bfloat16, 10)] * 3
