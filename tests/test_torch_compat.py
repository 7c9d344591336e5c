"""Round trips with torch.distributed.pipelining's own code, in-process, no process group.

PyTorch's schedule classes only read ``num_stages``, ``group_size``, ``group_rank`` and ``stage_index``
from their stage objects while building their order, so plain namespaces stand in for real stages.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipewright.codec import from_csv, load_csv
from pipewright.deps import CORE_KINDS
from pipewright.ir import KindSpec, Schedule
from pipewright.passes import lower, validate
from pipewright.passes.pytorch_csv import to_csv
from pipewright.schedules import build_schedule, info, schedule_names

S = pytest.importorskip("torch.distributed.pipelining.schedules")
_PRIVATE = ("_PipelineScheduleRuntime", "_add_send_recv", "_simulate_comms_compute", "_Action")
if not all(hasattr(S, name) for name in _PRIVATE):
    pytest.skip("this PyTorch lacks the schedule IR helpers these tests use", allow_module_level=True)

#: Our names that PyTorch also implements, and its class where it generates the same order.
TORCH_TWINS = {
    "gpipe": None,
    "1f1b": None,
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zb-h1": None,
    "zbv": None,
    "zbv-torch": None,
}
SAME_ORDER = [name for name, cls in TORCH_TWINS.items() if cls]
SHARED = [name for name in TORCH_TWINS if name in schedule_names()]

#: PyTorch's FSDP actions, registered so its full lowered schedules load (they need nothing here).
TORCH_KINDS = CORE_KINDS.with_kinds(
    KindSpec("UNSHARD", lambda a, s: (), compute=False, torch=True),
    KindSpec("RESHARD", lambda a, s: (), compute=False, torch=True),
)


def _fake_stages(p: int, v: int, style: str = "loop") -> list[SimpleNamespace]:
    """Rank 0's stages, with just the attributes PyTorch's schedule constructors read."""
    local = [0, 2 * p - 1] if style == "v" else [c * p for c in range(v)]
    return [
        SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=s, submod=None)
        for s in local
    ]


def _runtime(p: int, m: int, v: int) -> S._PipelineScheduleRuntime:
    return S._PipelineScheduleRuntime(_fake_stages(p, v), m)


def _rows_csv(rows) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])
    return buf.getvalue()


def _torch_actions(sched: Schedule) -> dict[int, list]:
    """Our compute-only CSV read back by PyTorch's own action parser."""
    rows = csv.reader(io.StringIO(to_csv(sched)))
    return {r: [S._Action.from_str(cell) for cell in row] for r, row in enumerate(rows)}


def _shapes(name: str) -> list[tuple[int, int, int]]:
    entry = info(name)
    v = entry.default_chunks
    return [(p, max(m, entry.min_microbatches(p, v)), v) for p, m in [(2, 4), (4, 8), (4, 12)]]


def _comms(rows) -> list[set[str]]:
    """Each rank's send and receive actions, as strings."""
    return [{str(a) for a in row if a.kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")} for row in rows]


@pytest.mark.parametrize("name", SHARED)
def test_torch_accepts_and_lowers_our_schedules(name: str, tmp_path: Path) -> None:
    for p, m, v in _shapes(name):
        sched = build_schedule(name, p, m, v)
        path = tmp_path / f"{name}.csv"
        path.write_text(to_csv(sched))
        runtime = _runtime(p, m, v)
        runtime._load_csv(str(path))  # PyTorch's _validate_schedule, then its lowering passes
        assert runtime.stage_index_to_group_rank == dict(enumerate(sched.placement))
        # PyTorch's full lowered schedule (FSDP actions, REDUCE_GRAD, send/recv) runs in pipewright
        torch_rows = [runtime.pipeline_order_with_comms[r] for r in range(p)]
        validate(from_csv(_rows_csv(torch_rows), placement=sched.placement, kinds=TORCH_KINDS))
        # _add_send_recv alone: the same point-to-point actions as our lowering, and it validates
        with_comms = S._add_send_recv(_torch_actions(sched), sched.placement.__getitem__, sched.num_stages)
        theirs = from_csv(_rows_csv(with_comms[r] for r in range(p)), name=name, placement=sched.placement)
        validate(theirs)
        assert _comms(theirs.actions) == _comms(lower(sched).actions) != [set()] * p
        # and PyTorch's simulator runs our lowered schedule to the end
        ours = {r: [S._Action.from_str(str(a)) for a in row] for r, row in enumerate(lower(sched).actions)}
        S._simulate_comms_compute(ours, sched.placement.__getitem__, sched.num_stages)


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("name", [n for n in SAME_ORDER if n in schedule_names()])
def test_same_order_as_pytorch(name: str, v: int, tmp_path: Path) -> None:
    cls = getattr(S, TORCH_TWINS[name])
    for p in range(2, 9):
        for m in (p, 2 * p, 4 * p):
            sched = build_schedule(name, p, m, v)
            theirs = cls(_fake_stages(p, v), m)
            order = [[str(a) for a in theirs.pipeline_order[r] if a is not None] for r in range(p)]
            assert order == [[str(a) for a in row] for row in sched.actions], (name, p, m, v)
    # a CSV PyTorch wrote itself (idle slots as empty cells) loads into an equal, valid schedule
    path = tmp_path / "torch.csv"
    theirs._dump_csv(str(path), format="compute_only")
    assert validate(load_csv(path)).actions == sched.actions


@pytest.mark.parametrize(
    ("cls", "v", "style"),
    [("ScheduleInterleavedZeroBubble", 2, "loop"), ("ScheduleZBVZeroBubble", 2, "v")],
)
def test_pytorch_zero_bubble_csv_validates(cls: str, v: int, style: str, tmp_path: Path) -> None:
    if not hasattr(S, cls):
        pytest.skip(f"this PyTorch has no {cls}")
    for p, m in [(2, 4), (4, 8)]:
        theirs = getattr(S, cls)(_fake_stages(p, v, style), m)
        path = tmp_path / "zb.csv"
        theirs._dump_csv(str(path), format="compute_only")
        sched = validate(load_csv(path))
        assert any(a.kind == "W" for row in sched.actions for a in row)
        validate(lower(sched))
