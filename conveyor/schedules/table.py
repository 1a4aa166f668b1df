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
the B, joined by ``+``. A pipeline-wide pass (:class:`~conveyor.schedules.core.Pass`,
:attr:`~conveyor.schedules.core.Schedule.vocab`) is written ``<kind><microbatch>`` (a
capital letter other than F, B and W: vocabulary parallelism's E, S, T or G, e.g. ``S3``)
on every rank's line, where that rank runs it (its slot); every rank lists the passes in
the same order. A
rank's program may be spread over several ``rank N:`` lines; they are joined in order.
``name`` (default ``custom``) and ``split_backward`` (default false) may be left out.

Every field of a :class:`~conveyor.schedules.core.Schedule` is written, and
:func:`to_table` refuses a schedule whose table would read back as another.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import cast

from conveyor.errors import ScheduleError
from conveyor.schedules.checks import validate
from conveyor.schedules.core import Action, Kind, Pass, Schedule
from conveyor.schedules.order import instructions

_HEADER = "# conveyor schedule"
_KEYS = ("name", "ranks", "microbatches", "placement", "split_backward")
_ACTION = re.compile(r"([FBW])(\d+),(\d+)")
_PASS = re.compile(r"(?![FBW])([A-Z])(\d+)")
_RANK_LINE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def to_table(schedule: Schedule) -> str:
    """The text table of ``schedule``; :func:`from_table` reads it back unchanged.

    Args:
        schedule: Any schedule (not validated here).

    Returns:
        The table, ending in a newline.

    Raises:
        ScheduleError: If the table would not read back as ``schedule``, naming the
            field: e.g. a name that is empty, spans lines or has blanks at its ends, a
            pair index or a vocabulary slot that no position of the program can write.
    """
    text = _write(schedule)
    try:
        back = _read(text, "<table>")
    except ScheduleError as error:
        raise ScheduleError(f"to_table cannot write schedule {schedule.name!r}: {error}") from None
    for field in dataclasses.fields(Schedule):
        if field.compare and getattr(back, field.name) != getattr(schedule, field.name):
            raise ScheduleError(
                f"to_table cannot write schedule {schedule.name!r}: its {field.name} "
                f"{getattr(schedule, field.name)!r} would read back as "
                f"{getattr(back, field.name)!r}"
            )
    return text


def _write(schedule: Schedule) -> str:
    """The table's text (:func:`to_table` checks that it reads back)."""
    lines = [
        _HEADER,
        f"name: {schedule.name}",
        f"ranks: {schedule.ranks}",
        f"microbatches: {schedule.microbatches}",
        "placement: " + " ".join(str(r) for r in schedule.placement),
        f"split_backward: {'true' if schedule.split_backward else 'false'}",
    ]
    for rank in range(len(schedule.actions)):
        try:
            words = [str(step) for step in instructions(schedule, rank)]
        except (IndexError, ScheduleError) as error:
            raise ScheduleError(
                f"to_table cannot write schedule {schedule.name!r}: rank {rank}'s pairs "
                f"or vocabulary slots do not fit its program ({error})"
            ) from None
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


class _Program:
    """One rank's program as read so far: its actions, the index of each pair's F, and
    each pass with its slot (the count of actions before it)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pairs: list[int] = []
        self.passes: list[tuple[Pass, int]] = []

    def read(self, text: str, where: str) -> None:
        """Append the actions and passes of one ``rank N:`` line (what follows the colon)."""
        for token in text.split():
            found = _PASS.fullmatch(token)
            if found is not None:
                step = Pass(found[1], int(found[2]))
                self.passes.append((step, len(self.actions)))
                continue
            parts = token.split("+")
            if len(parts) > 2:
                raise ScheduleError(
                    f"{where}: {token!r} joins more than two actions; a pair is F+B"
                )
            if len(parts) == 2:
                self.pairs.append(len(self.actions))
            for part in parts:
                match = _ACTION.fullmatch(part)
                if match is None:
                    raise ScheduleError(
                        f"{where}: cannot read action {part!r}; write <kind><stage>,<microbatch> "
                        f"with kind F, B or W, e.g. F0,3 (or a pair F0,3+B0,1, or a "
                        f"vocabulary pass <kind><microbatch> with kind E, S, T or G, e.g. S3)"
                    )
                self.actions.append(Action(cast(Kind, match[1]), int(match[2]), int(match[3])))


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
    return validate(_read(text, source))


def _read(text: str, source: str) -> Schedule:
    """:func:`from_table` without the validation."""
    header: dict[str, str | int | bool | tuple[int, ...]] = {}
    programs: dict[int, _Program] = {}
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
            programs.setdefault(rank, _Program()).read(rank_match[2], where)
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
    read = [programs[r] for r in range(ranks)]
    vocab = tuple(v for v, _ in read[0].passes) if read else ()
    for rank, program in enumerate(read):
        if tuple(v for v, _ in program.passes) != vocab:
            raise ScheduleError(
                f"{source}: rank {rank} lists other vocabulary passes than rank 0, or in "
                f"another order; write every pass on every rank's line, in one order"
            )
    return Schedule(
        name=name,
        ranks=ranks,
        microbatches=microbatches,
        placement=placement,
        actions=tuple(tuple(p.actions) for p in read),
        split_backward=split_backward,
        pairs=tuple(tuple(p.pairs) for p in read),
        vocab=vocab,
        vocab_slots=tuple(tuple(slot for _, slot in p.passes) for p in read) if vocab else (),
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
