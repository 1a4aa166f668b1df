"""Schedule names -> generators; :func:`get_schedule` builds and validates one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.schedules.auto import zero_bubble_auto
from conveyor.schedules.core import Schedule, check_sizes, validate
from conveyor.schedules.dualpipev import dualpipev
from conveyor.schedules.gpipe import gpipe
from conveyor.schedules.interleaved import interleaved_1f1b
from conveyor.schedules.looped_bfs import looped_bfs
from conveyor.schedules.one_f_one_b import one_f_one_b
from conveyor.schedules.zbv import zbv
from conveyor.schedules.zero_bubble import zb_h1, zb_h2, zb_late

_ONE_CHUNK_HINT = "use 'zbv' or 'dualpipev' for two chunks per rank"
_V_HINT = "pass chunks=2 (rank r holds stages r and 2*ranks-1-r)"


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
    "looped-bfs": ScheduleSpec(looped_bfs),
    "zb-h1": ScheduleSpec(lambda p, m, v: zb_h1(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zb-h2": ScheduleSpec(lambda p, m, v: zb_h2(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zb-late": ScheduleSpec(lambda p, m, v: zb_late(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zbv": ScheduleSpec(lambda p, m, v: zbv(p, m), chunks=2, hint=_V_HINT),
    "dualpipev": ScheduleSpec(lambda p, m, v: dualpipev(p, m), chunks=2, hint=_V_HINT),
    # Unit costs and a cap of p micro-batches; the planner calls zero_bubble_auto with
    # measured costs.
    "zb-auto": ScheduleSpec(lambda p, m, v: zero_bubble_auto(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
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
