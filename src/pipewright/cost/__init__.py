"""Cost models: how long each action takes, what it sends, and what memory it holds."""

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.cost.unit import UnitCost

__all__ = ["CommModel", "CostModel", "FreeComm", "UnitCost"]
