"""Model to stage modules. ``balance`` is pure Python; the splitters need torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.partition.balance import balance

if TYPE_CHECKING:
    from conveyor.partition.sequential import layers_of, parameter_costs, split_sequential

__all__ = ["balance", "layers_of", "parameter_costs", "split_sequential"]


def __getattr__(name: str) -> Any:
    if name in {"layers_of", "parameter_costs", "split_sequential"}:
        from conveyor.partition import sequential

        return getattr(sequential, name)
    raise AttributeError(f"module 'conveyor.partition' has no attribute {name!r}")
