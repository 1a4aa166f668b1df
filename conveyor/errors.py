"""Exceptions conveyor raises; each message says what to do."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose.

    Catch it to handle any of them; each message is one sentence that says what to do.
    """


class ScheduleError(ConveyorError, ValueError):
    """A schedule is incomplete, out of dependency order, or can deadlock.

    Also a bad schedule table. The message names the rank and action (or the line) at
    fault.
    """


class ConfigError(ConveyorError, ValueError):
    """Bad arguments: the message says which one and how to fix it."""


class PipelineError(ConveyorError, RuntimeError):
    """A step failed at run time, e.g. a peer rank died or stalled."""


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint cannot be written, is missing or damaged, or does not fit the model.

    Raised by :func:`~conveyor.checkpoint.save`, :func:`~conveyor.checkpoint.load`,
    :func:`~conveyor.checkpoint.load_model_state` and ``weights=`` loads; the message says
    what to do.
    """

    __module__ = "conveyor.checkpoint"  # where users import it from, as tracebacks show it


def one_line(error: BaseException, limit: int | None = None) -> str:
    """An exception as one line, for logs, summaries and other errors' reasons.

    Args:
        error: Any exception.
        limit: Cut the message at a word boundary to about this many characters, marking
            the cut with ``" ..."``; ``None``: the whole message.

    Returns:
        ``Type: message`` with the message's whitespace (newlines too) collapsed, or
        just ``Type`` for an empty message.
    """
    text = " ".join(str(error).split())
    name = type(error).__name__
    if limit is not None and len(text) > limit:
        cut = text.rfind(" ", 0, limit)
        text = text[: cut if cut > limit // 2 else limit].rstrip(" ,;:") + " ..."
    return f"{name}: {text}" if text else name
