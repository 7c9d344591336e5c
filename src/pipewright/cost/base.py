"""The interface every cost model implements; the simulator and the planner depend only on it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pipewright.ir import Action, Schedule


@runtime_checkable
class CostModel(Protocol):
    """Per-action costs of one schedule's actions.

    - ``compute_time``: seconds an action occupies its rank's compute stream (0 for pure communication
      kinds, whose time the simulator derives from ``message_bytes`` and the topology).
    - ``message_bytes``: bytes a SEND_F/SEND_B carries (the stage boundary activation or its gradient),
      or bytes a REDUCE_GRAD all-reduces per device.
    - ``activation_bytes``: activation memory an action adds (positive, F) or frees (negative, B/W/I)
      on its rank.
    - ``static_bytes``: parameters, gradients and optimizer state held by ``rank``.
    - ``flops``: floating-point operations the action executes (recomputation included) — for
      achieved FLOP/s; ``model_flops`` the same without recomputation — for MFU.
    """

    def compute_time(self, action: Action, schedule: Schedule) -> float: ...

    def message_bytes(self, action: Action, schedule: Schedule) -> float: ...

    def activation_bytes(self, action: Action, schedule: Schedule) -> float: ...

    def static_bytes(self, rank: int, schedule: Schedule) -> float: ...

    def flops(self, action: Action, schedule: Schedule) -> float: ...

    def model_flops(self, action: Action, schedule: Schedule) -> float: ...


@runtime_checkable
class CommModel(Protocol):
    """Communication times between the ranks of one simulated pipeline.

    ``p2p_time(src, dst, nbytes)``: seconds to move ``nbytes`` from pipeline rank ``src`` to ``dst``
    (latency + size / bottleneck bandwidth of the best path).
    ``collective_time(op, rank, nbytes, group="dp", members=())``: seconds for ``rank``'s part in a
    collective ``op`` ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "barrier")
    over ``group`` — rank's data-parallel (``"dp"``) or tensor-parallel (``"tp"``) group, or, for a
    group that spans the pipeline (``"pp"`` or a feature's named group), the pipeline ranks
    ``members`` — with ``nbytes`` per device.
    """

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float: ...

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float: ...


class ConstantComm:
    """Every point-to-point transfer takes ``p2p`` seconds and every collective ``collective`` seconds,
    whatever its size and group (schedule studies in units of a stage's forward time)."""

    def __init__(self, p2p: float = 0.0, collective: float = 0.0) -> None:
        self.p2p, self.collective = p2p, collective

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        return self.p2p

    def collective_time(
        self, kind: str, rank: int, nbytes: float, group: str = "dp", members: tuple[int, ...] = ()
    ) -> float:
        return self.collective


class FreeComm(ConstantComm):
    """Communication costs nothing (``--cost unit``)."""

    def __init__(self) -> None:
        super().__init__(0.0, 0.0)
