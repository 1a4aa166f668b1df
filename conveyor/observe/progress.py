"""Training progress on one rank: a bar on a terminal, a log line every few steps."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from tqdm import tqdm

from conveyor.context import Context


class Trained(Protocol):
    """What :class:`Progress` reads of a pipeline (a :class:`conveyor.Pipeline` is one).

    It is described here rather than imported: ``conveyor.observe`` sits below the
    pipeline, which measures through it.
    """

    context: Context

    def measured_bubble(self) -> float:
        """The last step's bubble over every pipeline rank (a collective)."""
        ...


class Progress:
    """Training progress: call :meth:`step` on every rank after each ``train_step``.

    Rank 0 prints one line (``step N  loss L  T ms/step ...``) every ``every`` steps and
    after its first step; where stderr is a terminal it also shows a tqdm bar with the
    loss, so a log gets the lines only. The other ranks print nothing. With several
    processes the lines give the measured pipeline bubble (a collective, hence every
    rank calls); one process runs the stages one after another, so there is no bubble to
    measure and the lines say so once. With compiled stages, a step that compiled (the
    first, a new sequence length) prints its line with the seconds compiling took.

    Args:
        pipe: The pipeline being trained.
        total: Steps the run will take (the bar's length).
        every: Steps between printed lines; default a tenth of ``total`` (at least 1);
            0 prints none.
        desc: The bar's label.

    Attributes:
        pipe: The pipeline.
        every: Steps between printed lines.
        count: Steps done, resumed ones included (a resumed run sets it).
        shown: Whether this rank prints (rank 0).
        parallel: Whether several processes run the pipeline (the bubble is measured).
        bar: The tqdm bar (disabled off rank 0 or off a terminal).
    """

    def __init__(
        self, pipe: Trained, total: int, every: int | None = None, desc: str = "train"
    ) -> None:
        self.pipe = pipe
        self.every = max(total // 10, 1) if every is None else every
        self.count = 0  # steps done, resumed ones included (a resumed run sets it)
        self._first = True
        self.shown = pipe.context.rank == 0
        self.parallel = pipe.context.distributed
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit="step", disable=not (self.shown and terminal))
        self._step_start = time.perf_counter()
        self._compiled = 0.0  # compile seconds so far (compiled stages)

    def step(self, loss: Any, items: int) -> str:
        """Record one step: its loss, time, throughput and (with several processes) bubble.

        Args:
            loss: The step's loss (anything ``float()`` takes, e.g. a 0-d tensor).
            items: Samples in the step, for samples per second.

        Returns:
            The log line, on every rank (printed only where :attr:`shown`).
        """
        now = time.perf_counter()
        seconds, self._step_start = now - self._step_start, now
        self.count += 1
        value = float(loss)
        line = (
            f"step {self.count:5d}  loss {value:.4f}  {seconds * 1e3:.1f} ms/step  "
            f"{items / seconds:.0f} samples/s"
        )
        stats, compiled = getattr(self.pipe, "compile_stats", None), False
        if stats is not None and stats.total_seconds() > self._compiled + 0.05:
            compiled = True
            # the step compiled (its first, a new length): say how much of it that was
            spent, self._compiled = stats.total_seconds() - self._compiled, stats.total_seconds()
            line += f"  compiling {spent:.1f} s"
        if self.parallel:
            bubble = self.pipe.measured_bubble()
            line += f"  bubble {bubble:.2f}"
            self.bar.set_postfix(loss=f"{value:.4f}", bubble=f"{bubble:.2f}", refresh=False)
        else:
            self.bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        self.bar.update()
        due = self.count % self.every == 0 or self._first or compiled if self.every else False
        if self.shown and due:
            if self._first and not self.parallel:
                line += "  (one process runs the stages one after another: no bubble to measure)"
            self.bar.write(line)
        self._first = False
        return line

    def close(self) -> None:
        """Close the progress bar."""
        self.bar.close()
