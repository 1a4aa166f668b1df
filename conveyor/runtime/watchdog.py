"""Stall detection for waits that do not block the CPU (the CUDA path).

On CUDA, a transfer is waited for in stream order (``Work.wait()`` without a time-out only
makes the current stream wait), so the CPU runs ahead of the GPU and no call of ours is
the one that hangs when a peer dies: a later host sync or NCCL's own watchdog is. Passing
a time-out to ``wait`` would block the CPU per transfer instead. So a thread watches the
works in flight, each with what it is (``rank 1: F(stage 1, micro-batch 3) waiting for
activations ... from rank 0``): one not finished within the time-out is named in a
:class:`~conveyor.errors.PipelineError`, printed at once, and the process groups are
aborted so that whatever the main thread is blocked in returns with an error; the main
thread then raises the named error (:meth:`Watchdog.check`). NCCL's own time-out is set
longer than ours (:func:`conveyor.context.init`), so ours speaks first.

Another rank's failure is handled the same way: while a work has been in flight longer
than :data:`~conveyor._failure.SLICE`, the thread reads the failure board (at most
once a slice, :mod:`conveyor._failure`); a notice there becomes the failure, and
the groups are aborted at once instead of at the time-out.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

import conveyor._failure as failure
from conveyor.errors import PipelineError


class Watchdog:
    """Watches works in flight; see the module doc."""

    def __init__(
        self,
        timeout: float,
        on_expire: Callable[[], None] | None = None,
        poll: float | None = None,
        notices: Callable[[str], PipelineError | None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.failure: PipelineError | None = None
        self._on_expire = on_expire if on_expire is not None else _abort_groups
        # Another rank's failure, read from the board (given: tests).
        self._notices = notices if notices is not None else _claim
        self._poll = poll if poll is not None else min(1.0, max(timeout / 20, 0.01))
        self._lock = threading.Lock()
        self._works: list[tuple[float, dist.Work, str, str]] = []
        self._thread: threading.Thread | None = None

    def watch(self, work: dist.Work, doing: str, suspect: str) -> None:
        """Watch ``work``: ``doing`` (who waits for what) and ``suspect`` name it if it
        does not finish within the time-out."""
        self.check()
        with self._lock:
            self._works.append((time.monotonic() + self.timeout, work, doing, suspect))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="conveyor-watchdog", daemon=True
                )
                self._thread.start()

    def check(self) -> None:
        """Raise the watchdog's error if a watched work timed out."""
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        while self.failure is None:
            time.sleep(self._poll)
            now = time.monotonic()
            # Watched a slice ago or earlier: deadline - timeout + slice <= now.
            old = now + self.timeout - failure.SLICE
            with self._lock:
                self._works = [w for w in self._works if not w[1].is_completed()]
                late = next((w for w in self._works if w[0] <= now), None)
                slow = next((w for w in self._works if w[0] <= old), None)
            if late is not None:
                _, _, doing, suspect = late
                self.failure = PipelineError(
                    f"{doing} did not finish within {self.timeout:g} s; {suspect} may have "
                    f"died or stalled (time-out set with conveyor.init(timeout=...) or "
                    f"$CONVEYOR_TIMEOUT)"
                )
            elif slow is not None:
                self.failure = self._notices(slow[2])
            if self.failure is not None:
                print(f"conveyor: {self.failure}", file=sys.stderr, flush=True)
                self._on_expire()
                return


def _claim(doing: str) -> PipelineError | None:
    return failure.board().claim(doing)


def _abort_groups() -> None:
    """Abort every process group so that blocked NCCL calls and syncs return (gloo's,
    which cannot abort, are broken: :func:`conveyor._failure.break_groups`)."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:
        print(f"conveyor: could not abort the process groups ({exc})", file=sys.stderr)
    failure.abort_groups()
