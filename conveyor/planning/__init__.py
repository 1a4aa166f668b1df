"""Choosing how to run a model: one prediction from either of two sources.

What a model's units cost is one interface (:mod:`~conveyor.planning.costs`), filled by:

- measuring them on this machine: :mod:`~conveyor.planning.profiler` (the model cut into
  units, each timed by :mod:`~conveyor.planning.timing`; a meta-device model's units made
  real one at a time by :mod:`~conveyor.planning.meta`), calibrated by a few real steps
  (:mod:`~conveyor.planning.calibration`) over the link :mod:`~conveyor.planning.link`
  measures;
- counting them on the meta device (:mod:`~conveyor.planning.counting`, with
  :mod:`~conveyor.planning.model_count` what a count holds, :mod:`~conveyor.planning.tracing`
  the traced step, :mod:`~conveyor.planning.recording` what its operations do) against a
  :class:`Hardware` (:mod:`~conveyor.planning.devices`; collectives by
  :mod:`~conveyor.planning.collectives`): :mod:`~conveyor.planning.counted`.

Either goes through the one prediction (:mod:`~conveyor.planning.prediction`: balance,
recompute, simulated step and tail; :mod:`~conveyor.planning.memory`: memory per rank and
what fits). ``Pipeline(schedule="auto")`` and ``conveyor plan FILE.py`` use it on measured
units (:mod:`~conveyor.planning.planner`, :mod:`~conveyor.planning.candidate`,
:mod:`~conveyor.planning.plan_result`, :mod:`~conveyor.planning.vocab`);
:func:`estimate` (:mod:`~conveyor.planning.cluster`) and ``conveyor plan --model``
(:mod:`~conveyor.planning.search`) on counted ones, for a :class:`Layout`
(:mod:`~conveyor.planning.layout`).
"""

from conveyor.planning.cluster import Estimate, estimate
from conveyor.planning.devices import PRESETS, Hardware, hardware
from conveyor.planning.layout import Layout

__all__ = ["PRESETS", "Estimate", "Hardware", "Layout", "estimate", "hardware"]
