"""What NCCL needs from the process groups, checked on the CPU by recording the calls: the default
group bound to its device with a watchdog timeout above the hang report's deadline, every new group
with that timeout, the channels warmed by a send/receive each in one global order, the groups aborted
after a hang report."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.reliability import timeouts
from pipewright.runtime.setup import launch


@pytest.fixture
def nccl_world(monkeypatch):
    """A default group that reads as NCCL; every call to it recorded in the returned list."""
    calls: list[tuple] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    new_group = lambda ranks, **kw: calls.append(("new_group", ranks, kw)) or ranks  # noqa: E731
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(("all_reduce", kw.get("group"))))
    monkeypatch.setattr(dist, "send", lambda t, dst, group: calls.append(("send", tuple(group), dst)))
    monkeypatch.setattr(dist, "recv", lambda t, src, group: calls.append(("recv", tuple(group), src)))
    monkeypatch.setattr(timeouts, "_group_timeouts", {})
    return calls


def test_default_group_bound_to_its_device_with_a_watchdog_past_the_report(monkeypatch) -> None:
    seen: dict = {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("current", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(timeouts, "_group_timeouts", {})
    launch.init_from_env("nccl", timeout_s=60.0, threads=None, collective_timeout_s=900.0)
    assert seen["device_id"] == seen["current"] == torch.device("cuda", 3)
    assert seen["timeout"] == datetime.timedelta(seconds=900.0 + timeouts.REPORT_MARGIN_S)
    assert timeouts.REPORT_MARGIN_S >= 60  # the report's own waits (a few seconds, ten at most) fit


def test_channels_get_the_watchdog_timeout_and_warm_by_send_receive_in_one_order(nccl_world) -> None:
    """pp = 3 with the ring's channels both ways: each rank's warm-up is one send or receive per
    channel it is on, never an all-reduce (which opens no point-to-point connection), in the
    global (src, dst) order; the new groups carry the watchdog timeout."""
    timeouts.use_nccl_group_timeout(30.0)
    per_rank = {}
    for rank in range(3):
        nccl_world.clear()
        ParallelMesh(1, 3, 1, rank, torch.device("cpu")).open_channels()
        per_rank[rank] = list(nccl_world)
    groups = [c for c in per_rank[0] if c[0] == "new_group"]
    assert len(groups) == 6 and {c[2]["timeout"] for c in groups} == {datetime.timedelta(seconds=150)}
    pairs = sorted({(a, b) for a in range(3) for b in range(3) if a != b})
    for rank, calls in per_rank.items():
        p2p = [c for c in calls if c[0] != "new_group"]
        expected = [
            ("send", (a, b), b) if rank == a else ("recv", (a, b), a) for a, b in pairs if rank in (a, b)
        ]
        assert p2p == expected, rank


def test_a_hang_report_aborts_nccl_groups_not_gloo(monkeypatch) -> None:
    aborted = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: aborted.append(group))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert not timeouts.abort_device_groups() and aborted == []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert timeouts.abort_device_groups() and aborted == [None]


def test_the_run_guard_aborts_after_writing_the_hang_report(monkeypatch) -> None:
    """RunGuard turns a timeout into the hang report first, then aborts the device groups (in that
    order: the report is gathered through the store, not the groups)."""
    from pipewright.mesh import Mesh
    from pipewright.runtime.reliability import guard
    from pipewright.runtime.reliability.hang import HangError

    order: list[str] = []
    monkeypatch.setattr(guard, "hang_error", lambda *a: order.append("report") or HangError("hang: x", ""))
    monkeypatch.setattr(guard, "abort_device_groups", lambda: order.append("abort") or True)
    me = SimpleNamespace(mesh=SimpleNamespace(layout=Mesh(1, 2, 1)), board=None, _rows=(), out_dir=None)
    error = guard.RunGuard._hang(me, RuntimeError("timed out"))
    assert isinstance(error, HangError) and order == ["report", "abort"]
