"""This machine as a :class:`~conveyor.planning.devices.Hardware`, measured (stub)."""

from __future__ import annotations

from conveyor.planning.devices import Hardware


def measure(*, refresh: bool = False) -> Hardware:
    """This machine, measured once and cached."""
    raise NotImplementedError
