"""Exceptions conveyor raises; each message says what to do."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class ScheduleError(ConveyorError, ValueError):
    """A schedule is incomplete, out of dependency order, or can deadlock."""


class ConfigError(ConveyorError, ValueError):
    """Bad arguments: the message says which one and how to fix it."""


class PipelineError(ConveyorError, RuntimeError):
    """A step failed at run time, e.g. a peer rank died or stalled."""


def one_line(error: BaseException) -> str:
    """``Type: message`` with the message's whitespace (newlines too) collapsed."""
    text = " ".join(str(error).split())
    name = type(error).__name__
    return f"{name}: {text}" if text else name
