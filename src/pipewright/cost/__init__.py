"""Cost models: how long each action takes, what it sends, and what memory it holds."""

from pipewright.cost.base import CostModel
from pipewright.cost.unit import UnitCost

__all__ = ["CostModel", "UnitCost"]
