"""Run a function on N real processes (gloo, one thread each) and collect results.

A regression that makes ranks wait for each other forever must fail within a minute and
say which rank waited for what: every worker runs with ``$CONVEYOR_TIMEOUT`` =
:data:`CONVEYOR_TIMEOUT` seconds (unless the test's ``env`` or this process sets it), so
``conveyor.init()`` without a ``timeout`` raises conveyor's own ``PipelineError`` ("rank R:
ACTION waiting for ... from rank Q") well before the harness's limit, which is above it; a
rank that still gives no answer is named by the harness.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue as queues
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONVEYOR_TIMEOUT = 45.0
"""Seconds a worker's conveyor waits on a peer by default (conveyor's own default: 300)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    env: dict[str, str],
) -> None:
    os.environ.setdefault("CONVEYOR_TIMEOUT", f"{CONVEYOR_TIMEOUT:g}")
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **env,
    )
    torch.set_num_threads(1)
    try:
        # Bytes, not tensors: shared-memory tensors die with this process.
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report every failure to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def answer(
    queue: Any, timeout: float, waiting: list[int], results: dict[int, Any], errors: dict[int, str]
) -> tuple[int, str, Any]:
    """The next ``(rank, status, value)`` a worker put on ``queue``; if none comes within
    ``timeout`` seconds, an AssertionError naming the ranks of ``waiting`` that have not
    answered and the errors the others reported."""
    try:
        got: tuple[int, str, Any] = queue.get(timeout=timeout)
    except queues.Empty:
        silent = [r for r in waiting if r not in results and r not in errors]
        told = "".join(f"\nrank {r}: {e}" for r, e in sorted(errors.items()))
        limit = os.environ.get("CONVEYOR_TIMEOUT", f"{CONVEYOR_TIMEOUT:g}")
        raise AssertionError(
            f"rank(s) {silent} gave no result within {timeout:g} s (the harness's limit; "
            f"conveyor's time-out in the workers: {limit} s){told}"
        ) from None
    return got


def run(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    allow_errors: bool = False,
    expect: list[int] | None = None,
    fork: bool = False,
    exit_within: float | None = None,
) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` processes; returns results by rank.

    With ``fork``, the workers are forked from this process and inherit its imports (torch,
    conveyor, the test module: seconds of CPU per rank that spawned workers spend again
    each), unless this process already holds a process group (a forked group would be that
    one): then they are spawned too. Fork only from the test process (one compute thread,
    see conftest.py); workers that compile (inductor's worker pools) are spawned.

    Raises if any rank fails (unless ``allow_errors``, then the error text is the result),
    or, naming the silent ranks and the others' errors, when a rank gives no answer within
    ``timeout`` seconds (keep it above the workers' conveyor time-out, so that conveyor's
    named error comes first). With ``expect``, only those ranks are waited for (others are
    killed afterwards). With ``exit_within``, a waited-for process still running that many
    seconds after the last answer is an AssertionError (it lingers, e.g. in exit hooks)
    instead of being killed silently.
    """
    waiting = list(range(world)) if expect is None else expect
    ctx = mp.get_context("fork" if fork and not dist.is_initialized() else "spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, env or {}))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while any(r not in results and r not in errors for r in waiting):
            rank, status, value = answer(queue, timeout, waiting, results, errors)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        answered = time.monotonic()
        lingering = []
        for r, p in enumerate(procs):
            limit = 10.0 if exit_within is None else answered + exit_within - time.monotonic()
            p.join(timeout=max(limit, 0) if r in waiting else 0)
            if p.is_alive():
                lingering += [r] if r in waiting else []
                p.kill()
                p.join()
    if exit_within is not None and lingering:
        raise AssertionError(
            f"rank(s) {lingering} still running {exit_within:g} s after the last answer"
        )
    failed = {r: e for r, e in errors.items() if r in waiting}  # of the ranks waited for
    if failed and not allow_errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
    return [results.get(r, errors.get(r)) for r in waiting]
