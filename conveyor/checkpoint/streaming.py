"""What both directions of ``conveyor convert`` share: what a direction wrote, and giving
the memory of each tensor written back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, NamedTuple


class Written(NamedTuple):
    """What one direction wrote (:class:`~conveyor.checkpoint.convert.Conversion` less the
    path and format)."""

    tensors: int
    nbytes: int
    files: list[str]
    note: str | None = None


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Give freed memory back to the system. glibc keeps a freed block that sat below
    its heap's top resident, and the small objects each write leaves (DCP's records)
    fill such holes, so the next tensor of the same size takes new memory: without this,
    the process would grow by about each tensor up to glibc's mmap threshold (32 MiB)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
