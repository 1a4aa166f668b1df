"""Training progress on one rank: a bar on a terminal, a log line every few steps."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from conveyor.pipeline import Pipeline


class Progress:
    """Call :meth:`step` on every rank after each ``train_step``.

    Rank 0 prints one line (``step N  loss L  T ms/step ...``) every ``every`` steps
    (default: a tenth of ``total``) and after its first step; where stderr is a terminal
    it also shows a tqdm bar with the loss, so a log gets the lines only. The other ranks
    print nothing. With several processes the lines give the measured pipeline bubble (a
    collective, hence every rank calls); one process runs the stages one after another,
    so there is no bubble to measure and the lines say so once.
    """

    def __init__(
        self, pipe: Pipeline, total: int, every: int | None = None, desc: str = "train"
    ) -> None:
        self.pipe = pipe
        self.every = max(total // 10, 1) if every is None else every
        self.count = 0  # steps done, resumed ones included (a resumed run sets it)
        self._first = True
        self.shown = pipe.context.rank == 0
        self.parallel = pipe.context.distributed
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, unit="step", disable=not (self.shown and terminal))
        self._last = time.perf_counter()

    def step(self, loss: Any, items: int) -> str:
        """Record one step of ``items`` samples; returns the log line (on every rank)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.count += 1
        value = float(loss)
        line = (
            f"step {self.count:5d}  loss {value:.4f}  {seconds * 1e3:.1f} ms/step  "
            f"{items / seconds:.0f} samples/s"
        )
        if self.parallel:
            bubble = self.pipe.measured_bubble()
            line += f"  bubble {bubble:.2f}"
            self.bar.set_postfix(loss=f"{value:.4f}", bubble=f"{bubble:.2f}", refresh=False)
        else:
            self.bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        self.bar.update()
        if self.shown and self.every and (self.count % self.every == 0 or self._first):
            if self._first and not self.parallel:
                line += "  (one process runs the stages one after another: no bubble to measure)"
            self.bar.write(line)
        self._first = False
        return line

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()
