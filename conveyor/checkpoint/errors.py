"""The error every checkpoint failure is raised as (defined with conveyor's other errors,
so that modules below the checkpoints, such as ``weights=`` loading, raise it too)."""

from __future__ import annotations

from conveyor.errors import CheckpointError

__all__ = ["CheckpointError"]
