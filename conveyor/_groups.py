"""The process groups (and device mesh) conveyor makes, held in one place and let go at exit.

A gloo process group's worker threads are joined only when the group object is freed, not
by ``destroy_process_group()``. Held by a ``Context`` that the user's script still
references at exit, they would live into interpreter finalization, where a worker freeing
its last finished work's tensor takes the GIL and is ended by CPython with
``pthread_exit``, which aborts the process ("terminate called without an active
exception") although training finished. So conveyor's objects hold a :class:`Held` handle
instead, and the exit hook calls :func:`release_all` while the interpreter is alive: the
groups are freed and their threads joined then.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, TypeVar

from conveyor.errors import PipelineError

T = TypeVar("T")

_held: dict[int, Any] = {}
_keys = itertools.count()


class Held(Generic[T]):
    """A handle to an object kept in the registry until :func:`release_all`."""

    __slots__ = ("_key",)

    def __init__(self, value: T) -> None:
        self._key = next(_keys)
        _held[self._key] = value

    def get(self) -> T:
        """The object; raises once it has been released at exit."""
        try:
            return _held[self._key]  # type: ignore[no-any-return]
        except KeyError:
            raise PipelineError(
                "conveyor's process groups were released at interpreter exit; call "
                "conveyor.init() again to use distributed features"
            ) from None


def release_all() -> None:
    """Let go of every held object (the exit hook; the interpreter is still alive)."""
    _held.clear()
