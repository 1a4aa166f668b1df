"""Model to stage modules."""

from __future__ import annotations

from conveyor.partition.balance import balance
from conveyor.partition.sequential import layers_of, parameter_costs, split_sequential

__all__ = ["balance", "layers_of", "parameter_costs", "split_sequential"]
