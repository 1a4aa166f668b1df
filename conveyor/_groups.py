"""The process groups (and device mesh) conveyor makes, held in one place and let go at exit.

A gloo process group's worker threads are joined only when the group object is freed, not
by ``destroy_process_group()``. Held by a ``Context`` that the user's script still
references at exit, they would live into interpreter finalization, where a worker freeing
its last finished work's tensor takes the GIL and is ended by CPython with
``pthread_exit``, which aborts the process ("terminate called without an active
exception") although training finished. So conveyor's objects hold a :class:`Held` handle
instead, and the exit hook calls :func:`release_all` while the interpreter is alive: the
groups are freed and their threads joined then.

Handles are not the only way to a group. Every ``DeviceMesh`` (a stage's DTensor
parameters hold a tensor-parallel sub-mesh, FSDP's parameters the data-parallel one) leads
to its root mesh, whose ``_pg_registry`` holds every group of the mesh; and FSDP keeps the
group it shards over in each unit's mesh info. The user's script holds those through the
pipeline and the optimizer until finalization. So a handle can also say how to cut such
links (:class:`Held`'s ``release``: the root mesh's registry is emptied), and objects made
elsewhere can be registered with :func:`on_release` (FSDP's mesh infos), weakly, so that
only those still alive at exit are touched.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from conveyor.errors import PipelineError

T = TypeVar("T")

_held: dict[int, tuple[Any, Callable[[Any], None] | None]] = {}
_keys = itertools.count()
_hooks: list[tuple[weakref.ref[Any], Callable[[Any], None]]] = []


class Held(Generic[T]):
    """A handle to an object kept in the registry until :func:`release_all`.

    Args:
        value: The object (a process group, a mesh, a dict of groups).
        release: Called with ``value`` when it is let go at exit, to cut the links to
            process groups that others still hold (e.g. a mesh's group registry).
    """

    __slots__ = ("_key",)

    def __init__(self, value: T, release: Callable[[T], None] | None = None) -> None:
        self._key = next(_keys)
        _held[self._key] = (value, release)

    def get(self) -> T:
        """The object; raises once it has been released at exit."""
        try:
            return _held[self._key][0]  # type: ignore[no-any-return]
        except KeyError:
            raise PipelineError(
                "conveyor's process groups were released at interpreter exit; call "
                "conveyor.init() again to use distributed features"
            ) from None


def on_release(obj: object, release: Callable[[Any], None]) -> None:
    """Call ``release(obj)`` at exit if ``obj`` is still alive then (held weakly).

    Args:
        obj: An object that holds process groups (it must support weak references).
        release: Drops ``obj``'s references to them.
    """
    _hooks[:] = [(ref, fn) for ref, fn in _hooks if ref() is not None]
    _hooks.append((weakref.ref(obj), release))


def forget_mesh_groups(mesh: Any) -> None:
    """Empty the group registry of ``mesh``'s root (every sub-mesh looks groups up there).

    Args:
        mesh: A ``torch.distributed.device_mesh.DeviceMesh``.
    """
    root = getattr(mesh, "_root_mesh", None) or mesh
    for each in (mesh, root):
        registry = getattr(each, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def held_groups() -> list[dist.ProcessGroup]:
    """Every process group held (alone or in a dict), once each: the mesh's, the tied
    weights', the vocabulary's. What a failure breaks (:mod:`conveyor._failure`)."""
    found: dict[int, dist.ProcessGroup] = {}
    for value, _ in list(_held.values()):
        for item in value.values() if isinstance(value, dict) else [value]:
            if isinstance(item, dist.ProcessGroup):
                found.setdefault(id(item), item)
    return list(found.values())


def release_all() -> None:
    """Let go of every held object (the exit hook; the interpreter is still alive)."""
    for ref, fn in _hooks:
        obj = ref()
        if obj is not None:
            with contextlib.suppress(Exception):  # best effort: the process is ending
                fn(obj)
    _hooks.clear()
    for value, release in _held.values():
        if release is not None:
            with contextlib.suppress(Exception):
                release(value)
    _held.clear()
