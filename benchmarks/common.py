"""What the distributed benchmark scripts share: starting themselves on N processes."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from conveyor.cli.launch import main as launch
from conveyor.context import in_torchrun

Step = Callable[[], None]


def timing_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The flags every timing benchmark takes: ``--rounds`` (default ``rounds``),
    ``--steps``, ``--warmup``, ``--quick`` and ``--json``; described by ``doc``'s first
    line."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run per round")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round of 1 step")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def step_times(step: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` between two barriers, after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def alternate(
    runs: dict[Any, Step],
    baseline: Step | None,
    rounds: int,
    timed: Callable[..., list[float]],
    steps: int,
    warmup: int,
) -> tuple[dict[Any, list[float]], list[float]]:
    """Seconds per step of every run and of ``baseline`` (a one-process loop this rank
    runs while the others wait), round by round; the runs' order flips every round so
    drift hits all alike."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    one_process: list[float] = []
    for r in range(rounds):
        dist.barrier()
        if baseline is not None:
            one_process += timed(baseline, steps, warmup, sync=False)
        dist.barrier()  # the other ranks idle here while this one measures the baseline
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[key] += timed(runs[key], steps, warmup)
    return times, one_process


def run_on_processes(
    script: str,
    procs: int,
    argv: list[str],
    worker: Callable[[argparse.Namespace], None],
    args: argparse.Namespace,
) -> int:
    """Outside torchrun, launch ``script`` with ``argv`` on ``procs`` processes (one thread
    each) and return its exit code; inside, run ``worker(args)`` and leave the group."""
    if not in_torchrun():
        os.environ["OMP_NUM_THREADS"] = "1"
        return launch(["--nproc-per-node", str(procs), os.path.abspath(script), *argv])
    worker(args)
    dist.destroy_process_group()
    return 0


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmHWM``: the peak resident set so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(
    rank: int,
    procs: int,
    port: int,
    queue: Any,
    fn: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
) -> None:
    """One of ``procs`` processes: ``fn(*args)`` on gloo, its result or error to ``queue``."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(*args)))
    except BaseException:  # every failure goes to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def on_processes(
    procs: int, fn: Callable[..., dict[str, Any]], *args: Any
) -> list[dict[str, Any]]:
    """``fn(*args)`` on ``procs`` processes forked from this one (which has imported torch,
    transformers and conveyor already), gloo; the results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    workers = [
        ctx.Process(target=child, args=(r, procs, port, queue, fn, args)) for r in range(procs)
    ]
    for p in workers:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(procs):
            rank, status, value = queue.get(timeout=900)
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
    finally:
        for p in workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(procs)]
