"""Point-to-point transfers between pipeline ranks, with receives posted ahead of time.

Each directed pair of pipeline ranks has its own two-rank process group (a *channel*, see
:meth:`ParallelMesh.open_channels`). Messages on a channel are matched in posting order, so the
receiver posts its receives in the **sender's** order, which it knows because every rank holds the
whole schedule. That makes early posting safe on NCCL (no tags, one stream per communicator: an early
receive on a channel only delays later receives on the same channel) and on gloo.

Every receive and every send is its own operation with its own Work (NCCL coalesces a
``batch_isend_irecv`` batch into one Work: waiting one receive of a batch would wait for all of it).
At most ``depth`` receives per channel are posted ahead (:meth:`PipeComm.prime` at step start, the next
one as each is consumed; the executor's ``recv_depth``, on CUDA by default its schedule's number of
stages), so receive buffers are bounded by the microbatches in flight, not allocated m per channel at
step start.
A send is released (its buffer freed) as soon as it is known complete: polled on CUDA, and under NCCL's
rules over gloo once this rank has received a message its peer sent after the matching receive.

Shapes and dtypes are given in advance by the executor (no handshake). A receive that does not
complete within ``timeout_s`` raises :class:`RecvTimeout` naming this rank, the action and the peer.
On CUDA a receive's wait only orders the compute stream after it (the host does not block or poll); its
deadline is checked when the step's sends and receives are finished (:meth:`PipeComm.finish`).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from pipewright.deps import matching_recv, peer_rank
from pipewright.ir import Action, Schedule
from pipewright.runtime.core.distributed_errors import RecvTimeout
from pipewright.runtime.parallel.process_mesh import ParallelMesh
from pipewright.runtime.reliability.timeouts import wait_work
from pipewright.runtime.setup import nccl_rules

#: (shape, dtype) of the tensor a RECV action receives.
TensorSpec = tuple[tuple[int, ...], torch.dtype]


class _Releases:
    """When this rank's sends are known received: ``after[R]`` = how many of this rank's sends to R's
    sender that sender's schedule receives before it sends what R receives. Rendezvous point-to-point
    (NCCL; gloo) completes a send once its receive is posted, so once R has arrived those sends are done.
    """

    def __init__(self, after: dict[Action, int], peers: set[int]) -> None:
        self.after = after
        self.peers = peers


def _releases(schedule: Schedule, me: int) -> _Releases:
    after: dict[Action, int] = {}
    peers: set[int] = set()
    kinds = schedule.kinds
    mine = [a for a in schedule.actions[me] if kinds[a.kind].comm == "send"]
    matched = {matching_recv(a, schedule): peer_rank(a, schedule) for a in mine}  # my sends' receives
    peers.update(matched.values())
    for src, row in enumerate(schedule.actions):
        if src == me:
            continue
        received_before = 0  # of my sends, how many src's row has received so far
        for a in row:
            if a in matched and matched[a] == src:
                received_before += 1
            elif kinds[a.kind].comm == "send" and peer_rank(a, schedule) == me:
                after[matching_recv(a, schedule)] = received_before
    return _Releases(after, peers)


def channel_pairs(schedule: Schedule) -> set[tuple[int, int]]:
    """Directed (src_pp, dst_pp) pairs the lowered schedule sends over."""
    return {
        (rank, peer_rank(a, schedule))
        for rank, row in enumerate(schedule.actions)
        for a in row
        if schedule.kinds[a.kind].comm == "send"
    }


class PipeComm:
    """This rank's sends and receives for one lowered schedule (reusable across iterations)."""

    def __init__(
        self,
        schedule: Schedule,
        mesh: ParallelMesh,
        recv_spec: Callable[[Action], TensorSpec],
        *,
        timeout_s: float = 300.0,
        scatter_gather: bool = False,
        depth: int | None = None,
    ) -> None:
        self.schedule = schedule
        self.mesh = mesh
        self.recv_spec = recv_spec
        self.timeout_s = timeout_s
        self.scatter_gather = scatter_gather and mesh.tp > 1
        self.depth = depth
        me = mesh.pp_rank
        # For each source pp rank: the receives of this rank in the order the source sends them.
        self._order: dict[int, list[Action]] = {}
        self._slot: dict[Action, tuple[int, int]] = {}
        for src, row in enumerate(schedule.actions):
            recvs = [
                matching_recv(a, schedule)
                for a in row
                if schedule.kinds[a.kind].comm == "send" and peer_rank(a, schedule) == me and src != me
            ]
            if recvs:
                self._order[src] = recvs
                for i, r in enumerate(recvs):
                    self._slot[r] = (src, i)
        # Each of this rank's sends → destination pp rank, computed once (the hot path looks it up).
        self._dst = {
            a: peer_rank(a, schedule) for a in schedule.actions[me] if schedule.kinds[a.kind].comm == "send"
        }
        self._releases = _releases(schedule, me)
        self._links: dict[tuple[int, int], tuple[dist.ProcessGroup, int, int]] = {}
        # Backends that cannot coalesce (gloo) run batch_isend_irecv's operations one by one; calling the
        # process group directly does the same without its per-operation Python wrappers.
        self._direct = mesh.device.type == "cpu" and not nccl_rules.active()
        # Sends known received are freed mid-step under NCCL's rules (on CUDA the host has not waited
        # for the receive, only the stream has: completion is polled instead); plain gloo frees them at
        # the step's end, which measured cheaper there (host memory is not the bound).
        self._release_received = mesh.device.type != "cuda" and nccl_rules.active()
        self.reset()

    def _link(self, src: int, dst: int) -> tuple[dist.ProcessGroup, int, int]:
        """(channel group, peer's rank in it, peer's global rank) of the channel src → dst (pp ranks)."""
        link = self._links.get((src, dst))
        if link is None:
            group = self.mesh.channel(src, dst)
            peer = self.mesh.pp_peer(dst if src == self.mesh.pp_rank else src)
            link = self._links[(src, dst)] = (group, dist.get_group_rank(group, peer), peer)
        return link

    def _start(
        self, send: bool, group: dist.ProcessGroup, group_peer: int, peer: int, tensors: list[torch.Tensor]
    ) -> list[dist.Work]:
        """Start a send (or receive) of each tensor with one peer: one Work per tensor, each completing
        on its own (not one ``batch_isend_irecv``, which NCCL completes as one Work)."""
        if self._direct:  # gloo: the process group's own calls, without the per-call Python wrappers
            method = group.send if send else group.recv
            return [method([t], group_peer, 0) for t in tensors]
        op = dist.isend if send else dist.irecv
        return [op(t, peer, group) for t in tensors]

    def reset(self) -> None:
        """Forget the previous iteration's state (call at iteration start)."""
        self._posted_upto = dict.fromkeys(self._order, 0)
        self._recvs: dict[Action, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: dict[int, deque[tuple[Action, dist.Work, torch.Tensor]]] = {}
        self._freed = dict.fromkeys(self._releases.peers, 0)  # sends released per peer
        self._waited: list[tuple[Action, dist.Work]] = []  # CUDA: receives whose deadline finish checks
        self._lock = threading.Lock()

    def held(self) -> int:
        """Receive buffers posted and not consumed plus sends not released: the boundary tensors this
        rank's communication holds now."""
        return len(self._recvs) + sum(len(q) for q in self._sends.values())

    # -- receives --------------------------------------------------------------------------
    def post(self, actions: Iterable[Action]) -> None:
        """Post (non-blocking) the receives ``actions`` and all receives before them in channel order."""
        target: dict[int, int] = {}
        for a in actions:
            if a not in self._slot:
                raise RecvTimeout(
                    f"rank {self.mesh.rank} (pp {self.mesh.pp_rank}): no rank's schedule sends what {a} "
                    "receives; the schedules of the ranks disagree"
                )
            src, i = self._slot[a]
            target[src] = max(target.get(src, 0), i + 1)
        for src, upto in sorted(target.items()):
            self._post_upto(src, upto)

    def prime(self) -> None:
        """Post the first ``depth`` receives of every channel (all of them when ``depth`` is None); each
        receive consumed later posts the next (:meth:`wait_recv`, :meth:`take_received`)."""
        for src, order in sorted(self._order.items()):
            self._post_upto(src, len(order) if self.depth is None else min(self.depth, len(order)))

    def _post_upto(self, src: int, upto: int) -> None:
        """Post the receives from ``src`` up to (excluding) index ``upto`` of its channel order."""
        start = self._posted_upto[src]
        if upto > start:
            batch = []
            for r in self._order[src][start:upto]:
                shape, dtype = self.recv_spec(r)
                piece = self._piece(math.prod(shape))
                buf = torch.empty(piece or shape, dtype=dtype, device=self.mesh.device)
                batch.append((r, buf))
            works = self._start(False, *self._link(src, self.mesh.pp_rank), [buf for _, buf in batch])
            for work, (r, buf) in zip(works, batch, strict=True):
                self._recvs[r] = (work, buf)
            self._posted_upto[src] = upto

    def _consumed(self, action: Action) -> None:
        """``action``'s receive is consumed: release the sends its arrival proves received, post the
        receive ``depth`` places after it on its channel."""
        self._release(action)
        if self.depth is not None:
            src, i = self._slot[action]
            self._post_upto(src, min(i + 1 + self.depth, len(self._order[src])))

    def wait_recv(self, action: Action) -> torch.Tensor:
        """The received tensor of ``action``, waiting at most ``timeout_s``."""
        if action not in self._recvs:
            self.post([action])
        work, buf = self._recvs.pop(action)
        if self.mesh.device.type == "cuda":
            work.wait()  # the compute stream waits for the receive; the host goes on launching
            self._waited.append((action, work))
        elif not self._wait(work):
            raise self._no_message(action)
        self._consumed(action)
        return self._full(action, buf)

    def _no_message(self, action: Action) -> RecvTimeout:
        src = self._slot[action][0]
        return RecvTimeout(
            f"rank {self.mesh.rank} (pp {self.mesh.pp_rank}): {action} received nothing from rank "
            f"{self.mesh.pp_peer(src)} (pp {src}) within {self.timeout_s:g} s"
        )

    def has_pending_receive(self, action: Action) -> bool:
        """Whether ``action``'s receive is posted and not yet consumed."""
        return action in self._recvs

    def pending_receive(self, action: Action) -> tuple[dist.Work, torch.Tensor]:
        """(work, buffer) of ``action``'s receive, posted first (with the receives before it in channel
        order) if it is not yet; it stays pending until :meth:`wait_recv` or :meth:`take_received`.
        For a caller that waits on the work itself (e.g. in a helper thread while it computes)."""
        if action not in self._recvs:
            self.post([action])
        return self._recvs[action]

    def take_received(self, action: Action) -> torch.Tensor:
        """Consume ``action``'s receive whose work the caller has already waited on (see
        :meth:`pending_receive`); returns its tensor (gathered over tp under scatter/gather)."""
        _, buf = self._recvs.pop(action)
        self._consumed(action)
        return self._full(action, buf)

    def _full(self, action: Action, buf: torch.Tensor) -> torch.Tensor:
        """The whole tensor of ``action``'s received ``buf``: all-gathered over tp when only a piece
        came (scatter/gather), else ``buf`` itself."""
        if self.scatter_gather:
            shape = self.recv_spec(action)[0]
            if self._piece(math.prod(shape)) is not None:
                return self._gather(buf, shape)
        return buf

    def _piece(self, numel: int) -> int | None:
        """Scatter/gather (Megatron-LM, Narayanan et al. SC21 §4.1): tp ranks hold the same boundary
        tensor, so each sends only its 1/tp share and the receivers all-gather it over tp."""
        tp = self.mesh.tp
        return numel // tp if self.scatter_gather and numel % tp == 0 else None

    def _gather(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        full = torch.empty(piece.numel() * self.mesh.tp, dtype=piece.dtype, device=piece.device)
        dist.all_gather(list(full.chunk(self.mesh.tp)), piece, group=self.mesh.tp_group)
        return full.view(shape)

    def _wait(self, work: dist.Work) -> bool:
        return wait_work(work, self.timeout_s, self.mesh.device)

    # -- sends -----------------------------------------------------------------------------
    def send(self, items: list[tuple[Action, torch.Tensor]]) -> None:
        """Start sending ``(SEND action, tensor)`` pairs, one ``batch_isend_irecv`` per peer."""
        by_peer: dict[int, list[tuple[Action, torch.Tensor]]] = {}
        for a, t in items:
            t = t.contiguous()
            if self.scatter_gather:
                piece = self._piece(t.numel())
                if piece is not None:
                    t = t.view(-1)[self.mesh.tp_rank * piece : (self.mesh.tp_rank + 1) * piece]
            dst = self._dst.get(a)
            by_peer.setdefault(peer_rank(a, self.schedule) if dst is None else dst, []).append((a, t))
        for dst, batch in sorted(by_peer.items()):
            works = self._start(True, *self._link(self.mesh.pp_rank, dst), [t for _, t in batch])
            with self._lock:
                queue = self._sends.setdefault(dst, deque())
                for work, (a, t) in zip(works, batch, strict=True):
                    queue.append((a, work, t))
                self._release_completed()

    def _release(self, received: Action) -> None:
        """Free the sends known complete now that ``received`` arrived: those to its sender whose
        receive the sender's schedule runs before the matching send (it has them; their waits return at
        once), and on CUDA any whose work reports completion."""
        src = self._slot[received][0]
        upto = self._releases.after.get(received, 0) if self._release_received else 0
        with self._lock:
            queue = self._sends.get(src)
            while queue and self._freed[src] < upto:
                a, work, _ = queue.popleft()
                self._freed[src] += 1
                self._finish_send(a, work)
            self._release_completed()

    def _release_completed(self) -> None:
        if self.mesh.device.type != "cuda":
            return  # gloo's works report completion only once waited
        for dst, queue in self._sends.items():
            while queue and queue[0][1].is_completed():
                queue.popleft()
                self._freed[dst] += 1

    def _finish_send(self, a: Action, work: dist.Work) -> None:
        if not self._wait(work):
            raise RecvTimeout(
                f"rank {self.mesh.rank} (pp {self.mesh.pp_rank}): {a} was not received by rank "
                f"{self.mesh.pp_peer(peer_rank(a, self.schedule))} within {self.timeout_s:g} s"
            )

    def finish(self) -> None:
        """Wait for every send of the iteration not yet released (and, on CUDA, check the deadline of
        the receives the compute stream waited for)."""
        for a, work in self._waited:
            if not self._wait(work):
                raise self._no_message(a)
        self._waited.clear()
        for queue in self._sends.values():
            while queue:
                a, work, _ = queue.popleft()
                self._finish_send(a, work)
        if self._recvs:
            left = ", ".join(str(a) for a in self._recvs)
            raise RuntimeError(f"rank {self.mesh.rank}: receives posted but never consumed: {left}")
