"""Pipeline schedules as data (pure Python, no torch import).

A :class:`Schedule` is one program of actions (:class:`Action`) per pipeline rank plus
the placement of stages on ranks. :func:`get_schedule` builds a named one
(:data:`SCHEDULE_NAMES`); the generators (:func:`gpipe`, :func:`one_f_one_b`,
:func:`interleaved_1f1b`, :func:`looped_bfs`, :func:`zb_h1`, :func:`zb_h2`,
:func:`zb_late`, :func:`zbv`, :func:`dualpipev`, :func:`v_half`, :func:`v_min`,
:func:`zero_bubble_auto`) can also be called directly; :func:`validate` checks any
schedule, :func:`walk` runs its ranks together (typed instructions: a rank's
:class:`Compute`, a pair grouped as one unit, or a :class:`Pass` every rank runs),
:func:`paired` / :func:`unpaired` mark or drop its overlapped forward / backward pairs, and
:func:`to_table` / :func:`from_table` write and read one as text.

The modules, by job: :mod:`~conveyor.schedules.core` (the data: actions, schedules, the
dependency rule), :mod:`~conveyor.schedules.order` (the one walk),
:mod:`~conveyor.schedules.checks` (validation), :mod:`~conveyor.schedules.pairs`
(overlapped pairs), :mod:`~conveyor.schedules.vocab` (vocabulary passes),
:mod:`~conveyor.schedules.table` (text), :mod:`~conveyor.schedules.simulation` (simulated
time), one module per generator.
"""

from __future__ import annotations

from conveyor.schedules.auto import zero_bubble_auto
from conveyor.schedules.checks import validate
from conveyor.schedules.core import (
    Action,
    B,
    F,
    Pass,
    Schedule,
    W,
    check_sizes,
    dependencies,
    loop_placement,
    make_schedule,
    v_placement,
)
from conveyor.schedules.dualpipev import dualpipev
from conveyor.schedules.gpipe import gpipe
from conveyor.schedules.interleaved import interleaved_1f1b
from conveyor.schedules.looped_bfs import looped_bfs
from conveyor.schedules.one_f_one_b import one_f_one_b
from conveyor.schedules.order import Compute, Instruction, execution_order, walk
from conveyor.schedules.pairs import paired, unpaired
from conveyor.schedules.registry import (
    SCHEDULE_NAMES,
    check_chunks,
    default_chunks,
    get_schedule,
)
from conveyor.schedules.table import from_table, load_schedule, save_schedule, to_table
from conveyor.schedules.v_shape import v_half, v_min
from conveyor.schedules.zbv import zbv
from conveyor.schedules.zero_bubble import zb_h1, zb_h2, zb_late

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "B",
    "Compute",
    "F",
    "Instruction",
    "Pass",
    "Schedule",
    "W",
    "check_chunks",
    "check_sizes",
    "default_chunks",
    "dependencies",
    "dualpipev",
    "execution_order",
    "from_table",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "load_schedule",
    "loop_placement",
    "looped_bfs",
    "make_schedule",
    "one_f_one_b",
    "paired",
    "save_schedule",
    "to_table",
    "unpaired",
    "v_half",
    "v_min",
    "v_placement",
    "validate",
    "walk",
    "zb_h1",
    "zb_h2",
    "zb_late",
    "zbv",
    "zero_bubble_auto",
]
