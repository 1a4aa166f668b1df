"""What the planner returns: :class:`Plan`, the chosen configuration with every candidate
ranked (:func:`conveyor.planning.planner.plan` makes it)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.planning.calibration import Calibration
from conveyor.planning.candidate import Candidate
from conveyor.planning.costs import Costs
from conveyor.schedules import Schedule


@dataclass(frozen=True)
class Plan:
    """The chosen configuration and the ranked alternatives.

    Attributes:
        schedule: The chosen schedule's name.
        chunks: Stages per rank.
        microbatches: Micro-batches per step.
        balance: Units per stage.
        predicted_step: Seconds per training step.
        peak_memory: Bytes per rank at the schedule's peak, as the one memory model counts
            them (:mod:`~conveyor.planning.memory`).
        alternatives: Every candidate, fastest fitting first, then those that do not fit.
        built: The schedule object to pass to ``Pipeline(schedule=...)`` (for ``zb-auto``
            it is fitted to the measured costs, so pass it rather than the name).
        memory_limit: The limit planned for, bytes per rank as ``peak_memory`` counts them.
        profile: The (calibrated) measurements the choice was made on.
        calibration: Of the chosen schedule's family, if calibration ran.
        recompute: Whether the plan recomputes every stage's forward at B (chosen only
            when nothing fits without): pass it as ``Pipeline(recompute=...)``.
        vocab_parallel: Whether the plan splits the vocabulary layers over every rank:
            pass it as ``Pipeline(vocab_parallel=...)``.
        basis: One sentence on what the times were measured on: each unit alone, and
            whether real steps calibrated them; always eager stages, and it says so when
            the options asked for ``compile=``, which planning does not apply.
    """

    schedule: str
    chunks: int
    microbatches: int
    balance: list[int]
    predicted_step: float
    peak_memory: list[int]
    alternatives: list[Candidate]
    built: Schedule
    memory_limit: float | None = None
    profile: Costs | None = None
    calibration: Calibration | None = None
    recompute: bool = False
    basis: str = ""
    vocab_parallel: bool = False

    def table(self) -> str:
        """The ranked alternatives as a markdown table.

        Returns:
            One row per candidate; the chosen one (the simplest of those within
            :data:`~conveyor.planning.planner.TIE` of the fastest) is marked.
        """
        lines = [
            "| # | schedule | chunks | micro-batches | balance | step ms | bubble "
            "| peak MB/rank | fits | chosen |",
            "|---:|---|---:|---:|---|---:|---:|---|---|---|",
        ]
        mine = (self.schedule, self.chunks, self.microbatches, tuple(self.balance),
                self.recompute, self.vocab_parallel)  # fmt: skip
        for i, c in enumerate(self.alternatives, 1):
            peak = ", ".join(f"{b / 2**20:.1f}" for b in c.peak_memory)
            chosen = (c.schedule, c.chunks, c.microbatches, c.balance, c.recompute,
                      c.vocab) == mine  # fmt: skip
            name = (
                c.schedule
                + (" + recompute" if c.recompute else "")
                + (" + vocab parallel" if c.vocab else "")
            )
            lines.append(
                f"| {i} | {name} | {c.chunks} | {c.microbatches} | "
                f"{list(c.balance)} | {c.predicted_step * 1e3:.2f} | {c.bubble:.3f} | {peak} | "
                f"{'yes' if c.fits else 'no'} | {'yes' if chosen else ''} |"
            )
        return "\n".join(lines)

    def zero_bubble_line(self) -> str:
        """zb-auto's predicted bubble beside ZB-H1's and ZB-H2's at the chosen micro-batch
        count (the hand-made schedules it is measured against), or "" when the plan did
        not simulate zb-auto there.

        Returns:
            One line, e.g. ``zb-auto predicted bubble 0.041 (zb-h1 0.112, zb-h2 0.083)``.
        """
        bubbles = {
            c.schedule: c.bubble
            for c in self.alternatives
            if c.microbatches == self.microbatches and not (c.recompute or c.vocab)
        }
        if "zb-auto" not in bubbles:
            return ""
        others = ", ".join(f"{n} {bubbles[n]:.3f}" for n in ("zb-h1", "zb-h2") if n in bubbles)
        return f"zb-auto predicted bubble {bubbles['zb-auto']:.3f}" + (
            f" ({others})" if others else ""
        )
