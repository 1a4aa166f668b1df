"""An overlapped pair: one micro-batch's forward and another's backward, interleaved at
their communications (the expert all-to-alls), so each is in flight during the other's
compute. This is the overlap DualPipe(V) was designed for; which actions pair up is
schedule data (:attr:`~conveyor.schedules.Schedule.pairs`).

The two actions run on two threads that pass one baton: only the holder computes. At a
communication (:func:`exchange`) the holder posts it, hands the baton to the other action
and waits for its transfer; it takes the baton back when the other action reaches its
own communication or ends. So the posts alternate F, B, F, B, ... in an order fixed by
the programs alone, the same on every rank of a group (NCCL's rule: collectives in one
order on every member). The waiting thread blocks (at most the time-out) while the other
computes: on CPU (gloo) the transfer runs on gloo's threads; on CUDA, NCCL runs it on its
own communication stream while the other thread queues its kernels on the compute stream.

Outside a pair, :func:`exchange` posts and waits, as a plain collective does. Every
exchange of a step is recorded as a span for the trace (:class:`Spans`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from conveyor.runtime.recompute import RngState, rng_state
from conveyor.runtime.timing import Timing
from conveyor.schedules import Action

T = TypeVar("T")
Work = Any


class Spans:
    """A step's communications on this rank, as :class:`Timing` of kind ``"A"``, with
    the stage and micro-batch of the action that posted each."""

    def __init__(self, rank: int, t0: float, into: list[Timing]) -> None:
        self.rank, self.t0, self.into = rank, t0, into
        self.action: Action | None = None  # the action running outside a pair

    def add(self, action: Action | None, began: float, ended: float) -> None:
        """Record one communication of ``action`` from ``began`` to ``ended``."""
        stage, mb = (action.stage, action.microbatch) if action is not None else (-1, -1)
        self.into.append(Timing(self.rank, "A", stage, mb, began - self.t0, ended - self.t0))


class Pair:
    """Two actions interleaved at their communications (see the module's description):
    :meth:`run` computes the first here and the second on a helper thread."""

    def __init__(self, first: Action, second: Action, device: torch.device) -> None:
        self.actions = (first, second)
        self._device = device
        # Each action's own random-number state: a forward drawing dropout masks and a
        # backward replaying a recomputed forward's masks must not draw from each other's
        # stream when they take turns.
        self._rng: list[RngState | None] = [None, None]
        self._turn = 0
        self._done = [False, False]
        self._cv = threading.Condition()
        self.compute = [0.0, 0.0]  # seconds each action held the baton
        self._held_since = 0.0
        self._first = 0  # the thread that runs the first action (set by run)

    def party(self) -> int:
        """Which action is calling: the first runs on the thread that called :meth:`run`,
        outside any backward; the second (a backward) on the helper thread, or inside
        autograd's backward (on CUDA autograd's own device thread). A recomputed forward
        runs on the helper thread before its backward starts."""
        inside = torch._C._current_graph_task_id() != -1
        return 0 if threading.get_ident() == self._first and not inside else 1

    def run(self, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
        """Both results; the first error either raised, after both ended."""
        results: list[Any] = [None, None]
        errors: list[BaseException | None] = [None, None]

        def body(k: int, call: Callable[[], Any]) -> None:
            try:
                self._acquire(k)
                results[k] = call()
            except BaseException as exc:  # handed to the caller below
                errors[k] = exc
            finally:
                self._release(k, done=True)

        self._first = threading.get_ident()
        helper = threading.Thread(target=body, args=(1, second), name="conveyor-pair")
        previous = _set_active(self)
        try:
            self._held_since = time.perf_counter()
            helper.start()
            body(0, first)
            helper.join()
        finally:
            _set_active(previous)
        final = self._rng[0]
        if final is not None:  # as after F then B: a backward draws no random numbers
            _set_rng(final, self._device)
        for error in errors:
            if error is not None:
                raise error
        return results[0], results[1]

    def handoff(self, wait: Callable[[], None]) -> None:
        """Called by the holder after posting a communication: let the other action
        compute while ``wait`` blocks for the transfer, then take the baton back."""
        k = self.party()
        self._release(k, done=False)
        try:
            wait()
        finally:
            self._acquire(k)

    def _acquire(self, k: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == k)
            self._held_since = time.perf_counter()
            mine = self._rng[k]
            if mine is not None:
                _set_rng(mine, self._device)

    def _release(self, k: int, done: bool) -> None:
        with self._cv:
            self._rng[k] = rng_state(self._device)
            self.compute[k] += time.perf_counter() - self._held_since
            self._done[k] = self._done[k] or done
            if not self._done[1 - k]:
                self._turn = 1 - k
            self._cv.notify_all()


def _set_rng(state: RngState, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


_active: Pair | None = None
_spans: Spans | None = None


def _set_active(pair: Pair | None) -> Pair | None:
    global _active
    previous, _active = _active, pair
    return previous


def record(spans: Spans | None) -> None:
    """Record this process's communications into ``spans`` (None: stop)."""
    global _spans
    _spans = spans


def exchange(start: Callable[[], Work | None], wait: Callable[[Work], None]) -> None:
    """Post a communication with ``start`` and wait for its work with ``wait``; inside a
    running :class:`Pair` the other action computes during the wait."""
    began = time.perf_counter()
    work = start()
    pair = _active
    if work is not None:
        if pair is None:
            wait(work)
        else:
            pair.handoff(lambda: wait(work))
    spans = _spans
    if spans is not None:
        action = pair.actions[pair.party()] if pair is not None else spans.action
        spans.add(action, began, time.perf_counter())
