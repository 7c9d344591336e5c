"""Cost models: how long each action takes, what it sends, and what memory it holds."""

from pipewright.cost.base import CommModel, CostModel, FreeComm
from pipewright.cost.comm import Mesh, TopologyComm
from pipewright.cost.profiled import ProfiledCost
from pipewright.cost.transformer import A100_EFFICIENCY, Efficiency, TransformerCost
from pipewright.cost.unit import UnitCost

__all__ = [
    "A100_EFFICIENCY",
    "CommModel",
    "CostModel",
    "Efficiency",
    "FreeComm",
    "Mesh",
    "ProfiledCost",
    "TopologyComm",
    "TransformerCost",
    "UnitCost",
]
