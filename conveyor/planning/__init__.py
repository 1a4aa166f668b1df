"""Choosing how to run a model: per-layer profiles (:mod:`~conveyor.planning.profiler`,
``conveyor.profile``) and the planner that picks split, schedule and chunks from them
(:mod:`~conveyor.planning.planner`, ``conveyor.plan``)."""
