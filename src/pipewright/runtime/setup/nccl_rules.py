"""NCCL's rules over gloo: a process-group mode that makes CPU runs fail where NCCL would.

Usage: set ``PIPEWRIGHT_PG_RULES=nccl`` before the process group is created (the test suite's
multi-process launches, ``tests/_queue_spawn.py``, set it by default; ``PIPEWRIGHT_PG_RULES=off`` turns
it off) or call :func:`install` after ``init_process_group("gloo", ...)``. gloo still moves the bytes;
the ``torch.distributed`` functions the runtime calls (``all_reduce``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``reduce``,
``barrier``, ``send``/``recv``/``isend``/``irecv``, ``batch_isend_irecv``) are wrapped so that:

* a ``batch_isend_irecv`` batch completes as **one** Work (the list returned holds one element), so
  waiting for any receive of a batch waits for all of it, as with NCCL's coalesced groups;
* operations on one communicator complete in issue order (waiting an operation first waits every
  operation issued before it on the same group: one NCCL stream per communicator);
* operations must match across ranks: every collective first all-gathers a small descriptor (per-group
  sequence number, operation, element count, dtype, shape) and every point-to-point message is preceded
  by its descriptor on the same channel, so a mismatch raises :class:`RulesMismatch` naming both ranks'
  operations instead of a silent reorder or an opaque hang;
* :func:`synchronize` (what the executor calls where CUDA code calls ``torch.cuda.synchronize``) waits
  for every operation posted and not yet waited, as a device-wide synchronize waits on the NCCL streams,
  and raises :class:`~pipewright.runtime.core.distributed_errors.CollectiveTimeout` naming the first one that
  does not
  complete in time (a deadlock is reported, not hung on);
* every tensor handed to an operation must be on the group's device: :func:`declare_device` (default
  ``PIPEWRIGHT_PG_DEVICE``, else the CPU) — a tensor elsewhere raises :class:`WrongDevice`.

``PIPEWRIGHT_PG_LAZY_CONNECT=<seconds>`` (or :func:`set_lazy_connect`) adds NCCL's lazy
point-to-point connection: the first send or receive between two ranks on a group blocks until the
peer's first one with this rank (off unless set; the test suite's launches set 30 s, so every
equivalence test runs with it: the runtime's point-to-point channel warm-up passes it).

A test writes a case as usual (``fork_launch``/``spawn_cases``) and gets the rules; to assert one fires,
catch :class:`RulesError` (mismatch, wrong device) or the timeout the deadlock produces. Code that must
know whether the rules are on (e.g. to pick NCCL's batched path over gloo's per-tensor one) calls
:func:`active`. The cost is one extra small message per point-to-point operation and one 8-integer
all-gather per collective.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pipewright.runtime.core.distributed_errors import CollectiveTimeout, DistributedError

ENV = "PIPEWRIGHT_PG_RULES"
DEVICE_ENV = "PIPEWRIGHT_PG_DEVICE"
LAZY_ENV = "PIPEWRIGHT_PG_LAZY_CONNECT"
_DESC = 8  # sequence, operation, numel, dtype, ndim, first three dims
_OPS = ("send", "recv", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
        "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast", "reduce",
        "barrier")  # fmt: skip
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool, torch.int16, torch.complex64)  # fmt: skip


class RulesError(DistributedError):
    """An operation NCCL would reject or mis-run."""


class RulesMismatch(RulesError):
    """Ranks issued different operations at the same place on one communicator."""


class WrongDevice(RulesError):
    """A tensor not on the device of the group it was handed to."""


_orig: dict[str, Callable] = {}
_lock = threading.Lock()
_device: torch.device = torch.device("cpu")
_declared: dict[Any, torch.device] = {}
_seq: dict[tuple, int] = {}
_pending: dict[Any, list[RulesWork]] = {}
_connected: set[tuple[int, int]] = set()
#: Lazy connection (off unless ``PIPEWRIGHT_PG_LAZY_CONNECT`` or :func:`set_lazy_connect`): its timeout.
_lazy: dict[str, float | None] = {"timeout_s": None}


def active() -> bool:
    """Whether the NCCL-rules mode is installed in this process."""
    return bool(_orig)


def requested() -> bool:
    """Whether the environment asks for the mode (``PIPEWRIGHT_PG_RULES=nccl``)."""
    return os.environ.get(ENV, "").strip().lower() == "nccl"


def install_from_env() -> bool:
    """Install the mode when :func:`requested` (call after ``init_process_group``); whether it is on."""
    if requested() and not active():
        install()
    return active()


def install(device: torch.device | str | None = None) -> None:
    """Wrap ``torch.distributed``'s operations with NCCL's rules (see the module docstring). ``device``:
    the default device of every group (else ``PIPEWRIGHT_PG_DEVICE``, else the CPU)."""
    global _device
    if dist.is_initialized() and dist.get_backend() != "gloo":
        raise RulesError(f"{ENV}=nccl models NCCL over gloo; this process group is {dist.get_backend()}")
    _device = torch.device(device or os.environ.get(DEVICE_ENV) or "cpu")
    if os.environ.get(LAZY_ENV):
        set_lazy_connect(float(os.environ[LAZY_ENV]))
    if active():
        return
    for name, fn in _WRAPPERS.items():
        _orig[name] = getattr(dist, name)
        setattr(dist, name, fn)
    for name in ("isend", "irecv"):  # P2POp checks its op against distributed_c10d's own names
        setattr(c10d, name, _WRAPPERS[name])


def uninstall() -> None:
    """Restore the plain ``torch.distributed`` functions and forget the mode's bookkeeping."""
    for name, fn in _orig.items():
        setattr(dist, name, fn)
        if name in ("isend", "irecv"):
            setattr(c10d, name, fn)
    _orig.clear()
    _declared.clear()
    _seq.clear()
    _pending.clear()
    _connected.clear()
    _lazy["timeout_s"] = None


def declare_device(group: Any, device: torch.device | str) -> None:
    """Declare the device of ``group`` (None: the default group): its operations take tensors there."""
    _declared[_key(group)] = torch.device(device)


def _key(group: Any) -> Any:
    return group if group is not None else c10d._get_default_group()


def _check_device(tensors: Sequence[torch.Tensor], group: Any, what: str) -> None:
    want = _declared.get(_key(group), _device)
    for t in tensors:
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise WrongDevice(
                f"rank {dist.get_rank()}: {what} on a {want} group was given a tensor on {t.device} "
                f"(shape {list(t.shape)}, {t.dtype}); NCCL takes tensors on the group's device only"
            )


def _describe(seq: int, op: str, t: torch.Tensor | None, sized: bool = True) -> torch.Tensor:
    """The descriptor [seq, op, numel, dtype, ndim, d0, d1, d2] of one operation (numel and shape 0
    when not ``sized``)."""
    if t is None:
        return torch.tensor([seq, _OPS.index(op), 0, -1, 0, 0, 0, 0], dtype=torch.int64, device=_device)
    shape = [*t.shape, 0, 0, 0][:3]
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
    desc = (
        [seq, _OPS.index(op), t.numel(), code, t.dim(), *shape]
        if sized
        else [seq, _OPS.index(op), 0, code, 0, 0, 0, 0]
    )
    return torch.tensor(desc, dtype=torch.int64, device=t.device)


def _text(desc: Sequence[int]) -> str:
    seq, op, numel, code, ndim, *dims = (int(x) for x in desc)
    what = _OPS[op] if 0 <= op < len(_OPS) else f"op {op}"
    if code < 0:
        return f"{what} #{seq}"
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "?"
    return f"{what} #{seq} of {numel} {dtype} (shape {dims[:ndim]}{'…' if ndim > 3 else ''})"


def _next_seq(key: tuple) -> int:
    with _lock:
        n = _seq.get(key, 0)
        _seq[key] = n + 1
        return n


class RulesWork:
    """One NCCL-like Work: gloo works completed together, after the works issued before it on its group,
    with descriptor checks run once their messages have arrived. Waited once; later waits return."""

    def __init__(self, group: Any, label: str) -> None:
        self.group = _key(group)
        self.label = label
        self.parts: list[tuple[dist.Work, Callable[[], None] | None]] = []
        self.keep: list[torch.Tensor] = []  # descriptors and buffers, alive until the work completes
        self.done = False
        self._wait_lock = threading.Lock()
        with _lock:
            _pending.setdefault(self.group, []).append(self)

    def add(self, work: dist.Work | None, check: Callable[[], None] | None = None) -> None:
        if work is not None:
            self.parts.append((work, check))

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for every operation issued before this one on its group, then for this one; a
        RuntimeError saying "timed out" when ``timeout`` passes first (as gloo's own wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        with _lock:
            queue = list(_pending.get(self.group, ()))
        for work in queue[: queue.index(self) + 1] if self in queue else [self]:
            work._wait_own(deadline, self)
        return True

    def _wait_own(self, deadline: float | None, waiter: RulesWork) -> None:
        with self._wait_lock:
            try:
                while self.parts:  # each gloo work is waited once (a second wait waits for another message)
                    work, check = self.parts[0]
                    try:
                        if deadline is None:
                            work.wait()
                        else:
                            work.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
                    except RuntimeError as e:  # gloo closes the pair on a timeout: the work is dead
                        self.parts.clear()
                        self._retire()
                        after = "" if waiter is self else f", issued before {waiter.label} on the same group"
                        raise RuntimeError(f"rank {dist.get_rank()}: {self.label}{after}: {e}") from e
                    self.parts.pop(0)
                    if check is not None:
                        check()
            except RulesError:
                self.parts.clear()  # reported once; the group is unusable from here on
                self._retire()
                raise
            self._retire()

    def _retire(self) -> None:
        self.done = True
        self.keep.clear()
        with _lock:
            queue = _pending.get(self.group, [])
            if self in queue:
                queue.remove(self)


def synchronize(timeout_s: float) -> None:
    """A device-wide synchronize: wait for every operation posted on any group and not yet waited.
    :class:`CollectiveTimeout` naming the first that does not complete within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _lock:
        works = [w for queue in _pending.values() for w in queue]
    for work in works:
        try:
            work.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
        except RuntimeError as e:
            raise CollectiveTimeout(
                f"rank {dist.get_rank()}: a device synchronize waits for {work.label}, which did not "
                f"complete within {timeout_s:g} s (NCCL: torch.cuda.synchronize hangs here)"
            ) from e


def device_synchronize(device: torch.device, timeout_s: float) -> None:
    """What a device-wide synchronize does on ``device``: :func:`synchronize` under the mode,
    ``torch.cuda.synchronize`` on CUDA, nothing on the CPU (its operations complete on the host)."""
    if active():
        synchronize(timeout_s)
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


# -- point-to-point ------------------------------------------------------------------------------
def _peer_global(peer: int | None, group: Any, group_peer: int | None) -> int:
    if peer is not None:
        return peer
    return dist.get_global_rank(_key(group), group_peer)


def set_lazy_connect(timeout_s: float | None) -> None:
    """Model NCCL's lazy point-to-point connection (None: off): the first send or receive between two
    ranks on a group blocks the host until the peer issues its own first one with this rank (NCCL
    creates the pair's communicator then, a blocking handshake; a collective does not open it). A
    :class:`RulesError` when the peer has not within ``timeout_s``: receives posted ahead on both sides
    of a channel pair before any send block each other this way unless the channels were warmed up
    with a send/receive pair in one global order."""
    _lazy["timeout_s"] = timeout_s


def _connect(group: Any, peer: int, what: str, tag: int) -> None:
    key = (id(_key(group)), peer)
    if _lazy["timeout_s"] is None or key in _connected:
        return
    me, timeout = dist.get_rank(), _lazy["timeout_s"]
    hello, echo = torch.zeros(1, device=_device), torch.empty(1, device=_device)
    works = [
        _orig["isend"](hello, dst=peer, group=group, tag=tag),
        _orig["irecv"](echo, src=peer, group=group, tag=tag),
    ]
    try:
        for work in works:
            work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RulesError(
            f"rank {me}: {what} is the first point-to-point operation with rank {peer} on its group; it "
            f"blocks until rank {peer} issues its first one with rank {me} (NCCL connects the pair "
            f"then), which it did not within {timeout:g} s: warm the channels up with a send/receive "
            "pair each, in one global order"
        ) from e
    _connected.add(key)


def _post_p2p(work: RulesWork, op: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> None:
    """Post one send or receive with its descriptor ahead of it on the same channel."""
    me = dist.get_rank()
    _connect(group, peer, f"{'isend to' if op == 'send' else 'irecv from'} rank {peer}", tag)
    _check_device([tensor], group, f"{'isend to' if op == 'send' else 'irecv from'} rank {peer}")
    seq = _next_seq((id(_key(group)), op, peer))
    mine = _describe(seq, op, tensor)
    work.keep += [mine, tensor]
    if op == "send":
        work.add(_orig["isend"](mine, dst=peer, group=group, tag=tag))
        work.add(_orig["isend"](tensor, dst=peer, group=group, tag=tag))
        return
    theirs = torch.empty_like(mine)
    work.keep.append(theirs)

    def check() -> None:
        got = theirs.tolist()
        if got[0] != seq or got[2:4] != mine.tolist()[2:4]:  # NCCL matches counts and types, not shapes
            raise RulesMismatch(
                f"rank {me} posted {_text(mine.tolist())} from rank {peer}, but rank {peer}'s matching "
                f"operation on that channel is {_text(got)}"
            )

    work.add(_orig["irecv"](theirs, src=peer, group=group, tag=tag), check)
    work.add(_orig["irecv"](tensor, src=peer, group=group, tag=tag))


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """``dist.isend`` under NCCL's rules."""
    peer = _peer_global(dst, group, group_dst)
    work = RulesWork(group, f"isend to rank {peer}")
    _post_p2p(work, "send", tensor, peer, group, tag)
    return work


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """``dist.irecv`` under NCCL's rules."""
    peer = _peer_global(src, group, group_src)
    work = RulesWork(group, f"irecv from rank {peer}")
    _post_p2p(work, "recv", tensor, peer, group, tag)
    return work


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    irecv(tensor, src, group, tag, group_src).wait()
    return src


def batch_isend_irecv(p2p_op_list):
    """``dist.batch_isend_irecv`` as NCCL runs it: one coalesced Work for the whole batch."""
    if not p2p_op_list:
        return []
    group = p2p_op_list[0].group
    if any(op.group is not group for op in p2p_op_list):
        raise RulesError("batch_isend_irecv: all operations of a batch must use one group")
    work = RulesWork(group, f"a batch of {len(p2p_op_list)} point-to-point operations")
    for op in p2p_op_list:
        peer = _peer_global(op.peer, group, getattr(op, "group_peer", None))
        _post_p2p(work, "send" if op.op is isend else "recv", op.tensor, peer, group, op.tag)
    return [work]


# -- collectives ---------------------------------------------------------------------------------
def _collective(
    name: str, group: Any, tensors: Sequence[torch.Tensor], start: Callable[[], Any], sized: bool = True
):
    """Check devices, all-gather this operation's descriptor over ``group``, start it; one RulesWork."""
    _check_device(tensors, group, name)
    key = _key(group)
    seq = _next_seq((id(key), "collective"))
    mine = _describe(seq, name, tensors[0] if tensors else None, sized)
    size = dist.get_world_size(key)
    everyone = torch.empty(size * _DESC, dtype=torch.int64, device=mine.device)
    work = RulesWork(group, f"{_text(mine.tolist())} on a group of {size}")
    work.keep += [mine, everyone, *tensors]
    me = dist.get_group_rank(key, dist.get_rank())

    def check() -> None:
        descs = everyone.view(size, _DESC).tolist()
        for r, d in enumerate(descs):
            if d[:4] != descs[me][:4]:  # sequence, operation, count, type
                raise RulesMismatch(
                    f"rank {dist.get_rank()} issued {_text(descs[me])} but rank "
                    f"{dist.get_global_rank(key, r)} issued {_text(d)} at that place on the same group"
                )

    gather = _orig.get("all_gather_single") or _orig["all_gather_into_tensor"]
    work.add(gather(everyone, mine, group=group, async_op=True), check)
    work.add(start())
    return work


def _finish(work: RulesWork, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def _wrap_collective(name: str, tensor_params: tuple[str, ...], sized: bool = True) -> Callable:
    """``dist.<name>`` under NCCL's rules: its tensors (the parameters ``tensor_params``, the one whose
    shape must agree across ranks first; ``sized=False`` where sizes may differ, as all-to-all splits)
    checked and described, then started asynchronously over gloo."""
    signature = inspect.signature(getattr(dist, name))

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        async_op, arguments["async_op"] = arguments["async_op"], True
        tensors = []
        for param in tensor_params:
            value = arguments[param]
            tensors += value if isinstance(value, list) else [value]
        work = _collective(
            name, arguments["group"], tensors, lambda: _orig[name](*bound.args, **bound.kwargs), sized
        )
        return _finish(work, async_op)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = f"``dist.{name}`` under NCCL's rules."
    return wrapper


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """``dist.barrier`` under NCCL's rules: the descriptor all-gather is the barrier."""
    return _finish(_collective("barrier", group, [], lambda: None), async_op)


_COLLECTIVES = {
    "all_reduce": ("tensor",),
    "all_gather": ("tensor", "tensor_list"),
    "all_gather_into_tensor": ("input_tensor", "output_tensor"),
    "all_gather_single": ("input_tensor", "output_tensor"),
    "reduce_scatter_tensor": ("input", "output"),
    "reduce_scatter_single": ("input", "output"),
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
}
_WRAPPERS: dict[str, Callable] = {
    "isend": isend,
    "irecv": irecv,
    "send": send,
    "recv": recv,
    "batch_isend_irecv": batch_isend_irecv,
    "barrier": barrier,
    **{name: _wrap_collective(name, params) for name, params in _COLLECTIVES.items() if hasattr(dist, name)},
    "all_to_all_single": _wrap_collective("all_to_all_single", ("input", "output"), sized=False),
}
