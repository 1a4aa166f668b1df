""":class:`~conveyor.integrations.lightning.PipelineStrategy` for the standalone
``pytorch_lightning`` package (``import pytorch_lightning as pl``).

Its Trainer accepts only its own strategy classes, so this module builds the same strategy
from the same source on ``pytorch_lightning`` and ``lightning_fabric`` instead of
``lightning.pytorch`` and ``lightning.fabric``: one implementation, two packages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["TRAINER_STATE", "PipelineStrategy"]

_PACKAGES = (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric"))


def _build() -> dict[str, Any]:
    """The names of :mod:`conveyor.integrations.lightning`, made on ``pytorch_lightning``."""
    spec = importlib.util.find_spec("conveyor.integrations.lightning")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for old, new in _PACKAGES:
        source = source.replace(old, new)
    names: dict[str, Any] = {"__name__": __name__, "__file__": spec.origin}
    exec(compile(source, spec.origin, "exec"), names)
    return names


_NAMES = _build()
PipelineStrategy: Any = _NAMES["PipelineStrategy"]
"""The strategy, a ``pytorch_lightning.strategies.ParallelStrategy``."""
TRAINER_STATE: str = _NAMES["TRAINER_STATE"]
"""The file with Lightning's own state in a checkpoint directory."""
