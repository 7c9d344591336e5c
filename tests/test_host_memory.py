"""The CPU allocator policy (runtime/setup/host_memory.py): with ``retain`` a worker that frees and allocates
the same large tensors again takes no page faults; with ``system`` (glibc's defaults) every 64 MiB
tensor is mapped afresh and faulted in page by page. Both through :func:`launch.spawn`, as a training
worker starts."""

from __future__ import annotations

import resource

import pytest
import torch

from pipewright.errors import ConfigError
from pipewright.runtime.setup.config import TrainConfig
from pipewright.runtime.setup.host_memory import _glibc, use_cpu_allocator
from pipewright.runtime.setup.launch import spawn
from pipewright.training import config_from_values

MIB = 2**20
glibc_only = pytest.mark.skipif(_glibc() is None, reason="the policy sets glibc's malloc")


def _faults_per_cycle(rank: int) -> float:
    """Minor page faults per allocate-touch-free cycle of a 64 MiB tensor, after twelve warm-up cycles:
    the heap grows to its steady size in the first ones (torch allocates aligned blocks, which a freed
    block of the same size cannot serve until it has coalesced with a neighbour)."""
    del rank
    cycles, warm = 4, 12
    for i in range(warm + cycles):
        if i == warm:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(64 * MIB // 4)
        x.fill_(1.0)
        del x
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / cycles


@glibc_only
def test_retain_reuses_pages_and_system_faults_them_in() -> None:
    pages = 64 * MIB / resource.getpagesize()
    retain = spawn(_faults_per_cycle, 1, cpu_allocator="retain", backend="gloo")[0]
    system = spawn(_faults_per_cycle, 1, cpu_allocator="system", backend="gloo")[0]
    assert retain < 0.01 * pages, retain
    assert system > 0.9 * pages, system


def test_unknown_policy_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="--cpu-allocator 'jemalloc': choose one of retain, system"):
        TrainConfig(cpu_allocator="jemalloc").check()
    with pytest.raises(ValueError, match="choose one of retain, system"):
        use_cpu_allocator("tcmalloc")


def test_toml_key() -> None:
    assert config_from_values({"cpu-allocator": "system"}).cpu_allocator == "system"
    assert TrainConfig().cpu_allocator == "retain"
