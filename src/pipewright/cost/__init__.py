"""Cost models: how long each action takes, what it sends, and what memory it holds.

The names below are imported on first use (PEP 562), so a command that needs only the unit cost
model does not pay for importing the transformer, MoE and attention cost models."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "A100_EFFICIENCY": "pipewright.cost.transformer",
    "CommModel": "pipewright.cost.base",
    "CostModel": "pipewright.cost.base",
    "Efficiency": "pipewright.cost.transformer",
    "FreeComm": "pipewright.cost.base",
    "Mesh": "pipewright.cost.comm",
    "ProfiledCost": "pipewright.cost.profiled",
    "TopologyComm": "pipewright.cost.comm",
    "TransformerCost": "pipewright.cost.transformer",
    "UnitCost": "pipewright.cost.unit",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipewright.cost' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
