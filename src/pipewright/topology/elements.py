"""The elements of a topology graph: devices and switches (:class:`Node`) and links (:class:`Edge`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    """A device (``accelerator`` set) or a switch (``accelerator`` None). ``host`` groups nodes of one
    machine; fabric switches have none."""

    name: str
    accelerator: str | None = None
    host: str | None = None

    @property
    def is_device(self) -> bool:
        return self.accelerator is not None


@dataclass(frozen=True)
class Edge:
    """An undirected link between nodes ``a`` and ``b``."""

    a: str
    b: str
    kind: str
    bandwidth: float
    latency: float
