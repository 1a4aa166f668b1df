"""Seeing what ran: per-action timings and Chrome traces (:mod:`~conveyor.observe.trace`),
timeline pictures (:mod:`~conveyor.observe.pictures`) and a training progress line
(:mod:`~conveyor.observe.progress`)."""
