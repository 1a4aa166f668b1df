"""Seeing what ran: per-action timings and Chrome traces (:mod:`~conveyor.observe.trace`),
a step's bubble and trace file gathered over every pipeline rank
(:mod:`~conveyor.observe.measure`), timeline pictures (:mod:`~conveyor.observe.pictures`)
and a training progress line (:mod:`~conveyor.observe.progress`)."""
