"""Cost models: how long each action takes, what it sends, and what memory it holds.

The names below are imported on first use (PEP 562), so a command that needs only the unit cost
model does not pay for importing the transformer, MoE and attention cost models."""

from __future__ import annotations

from pipewright.lazy import lazy_attributes

_WHERE = {
    "A100_EFFICIENCY": "pipewright.cost.transformer",
    "CommModel": "pipewright.cost.base",
    "ConstantComm": "pipewright.cost.base",
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

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, globals())
