"""A schedule as a plain text table that people can read, write and tweak.

Format (``#`` starts a comment line; blank lines are ignored)::

    # conveyor schedule
    name: 1f1b
    ranks: 2
    microbatches: 2
    placement: 0 1
    split_backward: false
    rank 0: F0,0 F0,1 B0,0 B0,1
    rank 1: F1,0 B1,0 F1,1 B1,1

``placement`` lists the rank of each stage (stage 0 first). Each action is
``<kind><stage>,<microbatch>`` with kind F, B or W; an overlapped pair
(:attr:`~conveyor.schedules.core.Schedule.pairs`) is written ``F0,3+B0,1``, the F then
the B, joined by ``+``. A rank's program may be spread over
several ``rank N:`` lines; they are joined in order. ``name`` (default ``custom``) and
``split_backward`` (default false) may be left out.
"""

from __future__ import annotations

import os
import re
from typing import cast

from conveyor.errors import ScheduleError
from conveyor.schedules.core import Action, Kind, Schedule, validate

_HEADER = "# conveyor schedule"
_KEYS = ("name", "ranks", "microbatches", "placement", "split_backward")
_ACTION = re.compile(r"([FBW])(\d+),(\d+)")
_RANK_LINE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def to_table(schedule: Schedule) -> str:
    """The text table of ``schedule``; :func:`from_table` reads it back unchanged.

    Args:
        schedule: Any schedule (not validated here).

    Returns:
        The table, ending in a newline.
    """
    lines = [
        _HEADER,
        f"name: {schedule.name}",
        f"ranks: {schedule.ranks}",
        f"microbatches: {schedule.microbatches}",
        "placement: " + " ".join(str(r) for r in schedule.placement),
        f"split_backward: {'true' if schedule.split_backward else 'false'}",
    ]
    for rank, program in enumerate(schedule.actions):
        starts = schedule.pair_starts(rank)
        words: list[str] = []
        for i, action in enumerate(program):
            if i - 1 in starts:
                words[-1] += f"+{action}"
            else:
                words.append(str(action))
        lines.append(f"rank {rank}: " + " ".join(words))
    return "\n".join(lines) + "\n"


def _int(value: str, key: str, where: str) -> int:
    """``value`` as an int >= 0; ScheduleError naming ``where`` and ``key`` otherwise."""
    try:
        number = int(value)
    except ValueError:
        raise ScheduleError(f"{where}: {key} must be an integer, got {value!r}") from None
    if number < 0:
        raise ScheduleError(f"{where}: {key} must be >= 0, got {number}")
    return number


def _parse_header(key: str, value: str, where: str) -> str | int | bool | tuple[int, ...]:
    """The value of one ``KEY: VALUE`` line, in the type ``key`` needs."""
    if key == "name":
        if not value:
            raise ScheduleError(f"{where}: name is empty; write e.g. 'name: custom'")
        return value
    if key in ("ranks", "microbatches"):
        return _int(value, key, where)
    if key == "placement":
        if not value:
            raise ScheduleError(f"{where}: placement is empty; list the rank of each stage")
        return tuple(_int(v, "each placement entry", where) for v in value.split())
    if value.lower() not in ("true", "false"):
        raise ScheduleError(f"{where}: split_backward must be true or false, got {value!r}")
    return value.lower() == "true"


def _parse_actions(text: str, where: str, program: list[Action], pairs: list[int]) -> None:
    """Append the actions of one ``rank N:`` line (what follows the colon) to
    ``program``, and the index of each pair's F to ``pairs``."""
    for token in text.split():
        parts = token.split("+")
        if len(parts) > 2:
            raise ScheduleError(f"{where}: {token!r} joins more than two actions; a pair is F+B")
        if len(parts) == 2:
            pairs.append(len(program))
        for part in parts:
            match = _ACTION.fullmatch(part)
            if match is None:
                raise ScheduleError(
                    f"{where}: cannot read action {part!r}; write <kind><stage>,<microbatch> "
                    f"with kind F, B or W, e.g. F0,3 (or a pair F0,3+B0,1)"
                )
            program.append(Action(cast(Kind, match[1]), int(match[2]), int(match[3])))


def from_table(text: str, source: str = "<table>") -> Schedule:
    """Parse a table written by :func:`to_table` (or by hand) and validate it.

    Args:
        text: The table (the format is in this module's description).
        source: What to call the text in errors, e.g. its file name.

    Returns:
        The validated schedule.

    Raises:
        ScheduleError: Naming ``source`` and the line at fault, or the rank and action at
            fault when the schedule itself is invalid.
    """
    header: dict[str, str | int | bool | tuple[int, ...]] = {}
    programs: dict[int, list[Action]] = {}
    pairs: dict[int, list[int]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source} line {number}"
        if not line or line.startswith("#"):
            continue
        rank_match = _RANK_LINE.fullmatch(line)
        if rank_match is not None:
            rank = int(rank_match[1])
            ranks = header.get("ranks")
            if not isinstance(ranks, int):
                raise ScheduleError(f"{where}: 'ranks: N' must come before the rank lines")
            if rank >= ranks:
                raise ScheduleError(f"{where}: rank {rank} is out of range 0..{ranks - 1}")
            program = programs.setdefault(rank, [])
            _parse_actions(rank_match[2], where, program, pairs.setdefault(rank, []))
            continue
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ScheduleError(
                f"{where}: cannot read {line!r}; expected 'KEY: VALUE' with KEY one of "
                f"{', '.join(_KEYS)}, or 'rank N: ACTIONS'"
            )
        if key in header:
            raise ScheduleError(f"{where}: {key} is given twice; keep one")
        header[key] = _parse_header(key, value.strip(), where)
    for key in ("ranks", "microbatches", "placement"):
        if key not in header:
            raise ScheduleError(f"{source}: the '{key}:' line is missing")
    ranks, microbatches, placement = header["ranks"], header["microbatches"], header["placement"]
    assert isinstance(ranks, int) and isinstance(microbatches, int)
    assert isinstance(placement, tuple)
    for rank in range(ranks):
        if rank not in programs:
            raise ScheduleError(f"{source}: no line for rank {rank}; add 'rank {rank}: ...'")
    name = header.get("name", "custom")
    split_backward = header.get("split_backward", False)
    assert isinstance(name, str) and isinstance(split_backward, bool)
    return validate(
        Schedule(
            name=name,
            ranks=ranks,
            microbatches=microbatches,
            placement=placement,
            actions=tuple(tuple(programs[r]) for r in range(ranks)),
            split_backward=split_backward,
            pairs=tuple(tuple(pairs[r]) for r in range(ranks)) if any(pairs.values()) else (),
        )
    )


def save_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` to ``path`` as a text table (:func:`to_table`), UTF-8.

    Args:
        schedule: The schedule.
        path: The file to write; replaced if it exists.

    Raises:
        OSError: If the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as file:
        file.write(to_table(schedule))


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule table from ``path`` and validate it (:func:`from_table`).

    Args:
        path: A file written by :func:`save_schedule` or by hand.

    Returns:
        The validated schedule.

    Raises:
        ScheduleError: Naming the file and the line, rank or action at fault.
        OSError: If the file cannot be read.
    """
    with open(path, encoding="utf-8") as file:
        return from_table(file.read(), source=os.fspath(path))
