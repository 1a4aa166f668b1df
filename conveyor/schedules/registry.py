"""Schedule names -> generators; :func:`get_schedule` builds and validates one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.schedules.auto import zero_bubble_auto
from conveyor.schedules.checks import validate
from conveyor.schedules.core import Schedule, check_sizes
from conveyor.schedules.dualpipev import dualpipev
from conveyor.schedules.gpipe import gpipe
from conveyor.schedules.interleaved import interleaved_1f1b
from conveyor.schedules.looped_bfs import looped_bfs
from conveyor.schedules.one_f_one_b import one_f_one_b
from conveyor.schedules.v_shape import v_half, v_min
from conveyor.schedules.zbv import zbv
from conveyor.schedules.zero_bubble import zb_h1, zb_h2, zb_late

# Hints name the arguments through {schedule} / {chunks} (see check_chunks), so the same
# text reads right for the Python API and for the command line.
_ONE_CHUNK_HINT = "use {schedule}zbv{end} or {schedule}dualpipev{end} for two chunks per rank"
_V_HINT = "pass {chunks}2 (rank r holds stages r and 2*ranks-1-r)"
_PYTHON_WORDS = {"schedule": "'", "chunks": "chunks=", "end": "'"}
_FLAG_WORDS = {"schedule": "--schedule ", "chunks": "--chunks ", "end": ""}


@dataclass(frozen=True)
class ScheduleSpec:
    """How to build a named schedule (one entry of the registry).

    Attributes:
        build: ``build(ranks, microbatches, chunks)`` returns the schedule.
        chunks: The chunk counts the schedule supports (one count, or a tuple of them),
            or None when any count >= 1 works.
        hint: Appended to the error for a wrong chunk count; ``{schedule}``, ``{end}``
            and ``{chunks}`` in it become Python or command-line wording.
        default: The chunk count used when none is given.
        one: For a schedule that interleaves chunks: the schedule it would silently be
            with one chunk per rank (one chunk is then refused).
    """

    build: Callable[[int, int, int], Schedule]
    chunks: int | tuple[int, ...] | None = None
    hint: str = ""
    default: int = 1
    one: str | None = None


# To add a schedule: write its generator and add one entry here.
_REGISTRY: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe),
    "1f1b": ScheduleSpec(
        lambda p, m, v: one_f_one_b(p, m),
        chunks=1,
        hint="use {schedule}interleaved-1f1b{end} for several chunks per rank",
    ),
    # With one chunk these are plain 1F1B and GPipe: the name asks for chunks.
    "interleaved-1f1b": ScheduleSpec(interleaved_1f1b, default=2, one="1f1b"),
    "looped-bfs": ScheduleSpec(looped_bfs, default=2, one="gpipe"),
    "zb-h1": ScheduleSpec(lambda p, m, v: zb_h1(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zb-h2": ScheduleSpec(lambda p, m, v: zb_h2(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zb-late": ScheduleSpec(lambda p, m, v: zb_late(p, m), chunks=1, hint=_ONE_CHUNK_HINT),
    "zbv": ScheduleSpec(lambda p, m, v: zbv(p, m), chunks=2, hint=_V_HINT, default=2),
    "dualpipev": ScheduleSpec(lambda p, m, v: dualpipev(p, m), chunks=2, hint=_V_HINT, default=2),
    # The controllable-memory V schedules: about 1/2 and 1/3 of 1F1B's activations.
    "v-half": ScheduleSpec(lambda p, m, v: v_half(p, m), chunks=2, hint=_V_HINT, default=2),
    "v-min": ScheduleSpec(lambda p, m, v: v_min(p, m), chunks=2, hint=_V_HINT, default=2),
    # Unit costs and a cap of p micro-batches, one stage per rank or a V; the planner
    # calls zero_bubble_auto with measured costs.
    "zb-auto": ScheduleSpec(
        lambda p, m, v: zero_bubble_auto(p, m, chunks=v),
        chunks=(1, 2),
        hint="use {schedule}interleaved-1f1b{end} for more chunks per rank",
    ),
}

SCHEDULE_NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""The names :func:`get_schedule` accepts."""


def _spec(name: str) -> ScheduleSpec:
    """The registry entry of ``name``; ConfigError listing the known names if none."""
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(repr(n) for n in SCHEDULE_NAMES)
        raise ConfigError(f"unknown schedule {name!r}; choose one of {known}")
    return spec


def default_chunks(name: str) -> int:
    """The chunks per rank schedule ``name`` runs when none are given.

    Args:
        name: A schedule name, one of :data:`SCHEDULE_NAMES`.

    Returns:
        2 for ``interleaved-1f1b`` and ``looped-bfs`` (with 1 they would be plain 1F1B
        and GPipe) and for the V schedules ``zbv``, ``dualpipev``, ``v-half`` and
        ``v-min`` (the only count they run), else 1.

    Raises:
        ConfigError: For an unknown name.
    """
    return _spec(name).default


def check_chunks(name: str, chunks: int | None = None, *, flags: bool = False) -> int:
    """The chunk count schedule ``name`` runs with: ``chunks``, or its default when None.

    The one rule for every caller (``get_schedule``, ``Pipeline``, ``conveyor simulate``):
    checks the count against the schedule (``1f1b`` runs 1, ``zbv`` 2, ``interleaved-1f1b``
    2 or more, ...); sizes below 1 are :func:`~conveyor.schedules.core.check_sizes`' job.

    Args:
        name: A schedule name, one of :data:`SCHEDULE_NAMES`.
        chunks: The requested stages per rank, or None for the default.
        flags: Word the error for the command line (``--chunks 2``) instead of for
            Python (``chunks=2``).

    Returns:
        The chunk count to build the schedule with.

    Raises:
        ConfigError: For an unknown name or a count the schedule cannot run, in one
            sentence naming the right schedule or count.
    """
    spec = _spec(name)
    if chunks is None:
        return spec.default
    words = _FLAG_WORDS if flags else _PYTHON_WORDS
    named = f"--schedule {name}" if flags else f"schedule {name!r}"
    if chunks == 1 and spec.one is not None:
        # Interleaving one chunk per rank would silently be plain 1F1B / GPipe.
        raise ConfigError(
            f"{named} interleaves several chunks per rank; pass {words['chunks']}"
            f"{spec.default} (or more), or use {words['schedule']}{spec.one}{words['end']} "
            f"for one"
        )
    counts = (spec.chunks,) if isinstance(spec.chunks, int) else spec.chunks
    if counts is not None and chunks not in counts:
        hint = f"; {spec.hint.format(**words)}" if spec.hint else ""
        runs = " or ".join(str(c) for c in counts)
        raise ConfigError(
            f"{named} runs {runs} chunk(s) per rank, got {words['chunks']}{chunks}{hint}"
        )
    return chunks


def get_schedule(name: str, ranks: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """Build the schedule called ``name`` and validate it.

    Args:
        name: A schedule name, one of :data:`SCHEDULE_NAMES`.
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        chunks: Stages per rank; None takes the schedule's default
            (:func:`default_chunks`).

    Returns:
        The validated schedule.

    Raises:
        ConfigError: For an unknown name, a chunk count the schedule does not support,
            sizes below 1, or fewer micro-batches than the schedule needs (``dualpipev``
            needs ``2 * ranks - 1``).
    """
    spec = _spec(name)
    check_sizes(ranks, microbatches, spec.default if chunks is None else chunks)
    chunk_count = check_chunks(name, chunks)
    return validate(spec.build(ranks, microbatches, chunk_count))
