"""A progress bar and a one-line log per step, shown on one rank only."""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from conveyor.pipeline import Pipeline


class Progress:
    """Call :meth:`step` on every rank after each ``train_step``.

    Rank 0 shows a tqdm bar with the loss, step time, throughput and the measured bubble,
    and every ``every`` steps writes that as one line (``step N  loss L  T ms/step ...``);
    the other ranks print nothing. The bubble is a collective, hence every rank calls.
    """

    def __init__(self, pipe: Pipeline, total: int, every: int = 0, desc: str = "train") -> None:
        self.pipe = pipe
        self.every = every
        self.count = 0
        self.shown = pipe.context.rank == 0
        self.bar = tqdm(total=total, desc=desc, unit="step", disable=not self.shown)
        self._last = time.perf_counter()

    def step(self, loss: Any, items: int) -> str:
        """Record one step of ``items`` samples; returns the log line (on every rank)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.count += 1
        bubble = self.pipe.measured_bubble()
        value = float(loss)
        line = (f"step {self.count:5d}  loss {value:.4f}  {seconds * 1e3:.1f} ms/step  "
                f"{items / seconds:.0f} samples/s  bubble {bubble:.2f}")
        self.bar.set_postfix(loss=f"{value:.4f}", bubble=f"{bubble:.2f}", refresh=False)
        self.bar.update()
        if self.shown and self.every and (self.count % self.every == 0 or self.count == 1):
            self.bar.write(line)
        return line

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()
