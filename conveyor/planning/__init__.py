"""Choosing how to run a model (``conveyor.profile``, ``conveyor.plan``).

- :mod:`~conveyor.planning.profile_data`: what a profile is, and its per-stage sums;
- :mod:`~conveyor.planning.unit_profile`: timing and sizing one unit on one micro-batch;
- :mod:`~conveyor.planning.link`: latency and bandwidth between ranks;
- :mod:`~conveyor.planning.profiler`: the model cut into units, each measured;
- :mod:`~conveyor.planning.meta`: a meta-device model's units made real one at a time;
- :mod:`~conveyor.planning.cost_model`: a candidate's balance, step time and memory;
- :mod:`~conveyor.planning.calibration`: a profile scaled to a few real steps;
- :mod:`~conveyor.planning.planner`: the search over schedules, chunks and micro-batches;
- :mod:`~conveyor.planning.plan_result`: the plan it returns, with every candidate ranked.

Planning for a cluster nobody has to own (``conveyor.planning.estimate``):

- :mod:`~conveyor.planning.counting`: a model's FLOPs, bytes and saved activations on meta
  (:mod:`~conveyor.planning.model_count` what a count holds, :mod:`~conveyor.planning.tracing`
  the traced step, :mod:`~conveyor.planning.recording` what its operations do);
- :mod:`~conveyor.planning.hardware`: the GPUs, and the rates their kernels reach;
- :mod:`~conveyor.planning.collectives`: transfers and collectives by NCCL's cost model;
- :mod:`~conveyor.planning.layout`: pp, tp, dp, ep, schedule and batch of a run;
- :mod:`~conveyor.planning.estimate`: a layout's step time and memory per GPU.
"""

from conveyor.planning.estimate import Estimate, estimate
from conveyor.planning.hardware import PRESETS, Hardware, hardware
from conveyor.planning.layout import Layout

__all__ = ["PRESETS", "Estimate", "Hardware", "Layout", "estimate", "hardware"]
