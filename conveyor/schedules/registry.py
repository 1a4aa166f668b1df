"""Schedule names -> generators; :func:`get_schedule` builds and validates one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.schedules.core import Schedule, check_sizes, validate
from conveyor.schedules.gpipe import gpipe
from conveyor.schedules.interleaved import interleaved_1f1b
from conveyor.schedules.one_f_one_b import one_f_one_b


@dataclass(frozen=True)
class ScheduleSpec:
    """How to build a named schedule.

    ``build(ranks, microbatches, chunks)`` returns the schedule. ``chunks`` is the only
    chunk count the schedule supports, or None when any count >= 1 works; ``hint`` is
    appended to the error for a wrong chunk count.
    """

    build: Callable[[int, int, int], Schedule]
    chunks: int | None = None
    hint: str = ""


# To add a schedule: write its generator and add one entry here.
_REGISTRY: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe),
    "1f1b": ScheduleSpec(
        lambda p, m, v: one_f_one_b(p, m),
        chunks=1,
        hint="use 'interleaved-1f1b' for several chunks per rank",
    ),
    "interleaved-1f1b": ScheduleSpec(interleaved_1f1b),
}

SCHEDULE_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""The names :func:`get_schedule` accepts."""


def get_schedule(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build the schedule called ``name`` and validate it.

    Raises :class:`~conveyor.errors.ConfigError` for an unknown name, a chunk count the
    schedule does not support, or sizes below 1.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(repr(n) for n in SCHEDULE_NAMES)
        raise ConfigError(f"unknown schedule {name!r}; choose one of {known}")
    check_sizes(ranks, microbatches, chunks)
    if spec.chunks is not None and chunks != spec.chunks:
        hint = f"; {spec.hint}" if spec.hint else ""
        raise ConfigError(
            f"schedule {name!r} runs {spec.chunks} chunk(s) per rank, got chunks={chunks}{hint}"
        )
    return validate(spec.build(ranks, microbatches, chunks))
