"""The default process group under :func:`conveyor.init`: the time-out, the backend, the
world's sizes, making the group and leaving it together at exit."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import conveyor._failure as failure
from conveyor._groups import release_all
from conveyor._mesh import backend_timeout, local_rank
from conveyor.errors import ConfigError

_exit_hook: Callable[[], None] | None = None
_exit_timeout = 300.0  # the last init's time-out, for the barrier at exit


def timeout_from(timeout: float | None, default: float) -> float:
    """``init``'s time-out in seconds (else ``$CONVEYOR_TIMEOUT``, else ``default``),
    checked before any process group is made: a finite number > 0."""
    if timeout is not None:
        number = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
        if not number or not math.isfinite(float(timeout)) or timeout <= 0:
            raise ConfigError(
                f"timeout must be a finite number of seconds > 0, got timeout={timeout!r}; "
                f"pass e.g. conveyor.init(timeout=300)"
            )
        return float(timeout)
    text = os.environ.get("CONVEYOR_TIMEOUT")
    if text is None:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(
            f"$CONVEYOR_TIMEOUT must be a finite number of seconds > 0, got {text!r}; set "
            f"e.g. CONVEYOR_TIMEOUT=300, or unset it for the default ({default:g} s)"
        )
    return seconds


def check_sizes(pp: int | None, dp: int, tp: int, ep: int, cp: int) -> None:
    """Each size an int >= 1 (``pp`` may be None), and ``ep`` a divisor of ``dp``."""
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp), ("ep", ep), ("cp", cp)):
        bad = not isinstance(value, int) or isinstance(value, bool) or value < 1
        if value is not None and bad:
            raise ConfigError(f"{name} must be an int >= 1, got {name}={value!r}")
    if dp % ep:
        raise ConfigError(
            f"ep={ep} does not divide dp={dp}: expert parallelism splits the data-parallel "
            f"ranks into groups of ep, so pick ep among the divisors of dp, or raise dp to a "
            f"multiple of {ep}"
        )


def pipeline_ranks(world: int, pp: int | None, dp: int, tp: int, cp: int) -> int:
    """``pp`` (default: what the world leaves after ``dp x cp x tp``), checked to make
    ``pp x dp x cp x tp`` the world size."""
    others = dp * cp * tp
    named = "dp x tp" if cp == 1 else "dp x cp x tp"
    if pp is None and world % others:
        raise ConfigError(
            f"{named} = {others} does not divide the world size {world}; launch a multiple "
            f"of {others} processes or pick sizes whose product divides {world}"
        )
    pp = world // others if pp is None else pp
    if pp * others != world:
        sizes = f"{pp} x {dp} x {tp}" if cp == 1 else f"{pp} x {dp} x {cp} x {tp}"
        product = "pp x " + named
        raise ConfigError(
            f"world size {world} is not {product} = {sizes}; launch {pp * others} processes "
            f"or change the sizes so that {product.replace(' x ', ' * ')} == {world}"
        )
    return pp


def join(backend: str | None, seconds: float, at_exit: Callable[[], None]) -> str:
    """Make the default process group unless one exists (whose backend must then be the
    one asked, if any); ``at_exit`` runs at interpreter exit, after this process left the
    group (:func:`leave`). Returns the group's backend."""
    global _exit_hook, _exit_timeout
    if dist.is_initialized():
        check_backend(backend, str(dist.get_backend()))
    else:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            # Bound to its GPU at once: the communicators are made eagerly, not lazily on
            # each rank pair's first transfer.
            kwargs["device_id"] = torch.device("cuda", local_rank())
        group_seconds = backend_timeout(backend, seconds)
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=group_seconds), **kwargs
        )
    # torch 2.13's gloo can abort at interpreter exit ("terminate called without an active
    # exception") when the group is never destroyed: destroy it at exit, whoever made it.
    _exit_timeout = seconds
    if _exit_hook is None:
        atexit.register(_leave_at_exit)
    _exit_hook = at_exit
    return str(dist.get_backend())


def check_backend(asked: str | None, existing: str) -> None:
    """``init(backend=asked)`` where a default process group of ``existing`` backend(s)
    (``"gloo"``, or per device ``"cpu:gloo,cuda:nccl"``) was made before: no backend
    asked, or one it has, is honoured; any other cannot be, and raises."""
    have = {part.rpartition(":")[2] for part in existing.split(",")}
    if asked is not None and asked not in have:
        raise ConfigError(
            f"backend={asked!r} cannot be honoured: the default process group already "
            f"exists with backend {existing!r} (made before conveyor.init, e.g. by "
            f"Lightning or the script); pass backend={existing!r} or none, or make the "
            f"group with {asked!r}"
        )


def _leave_at_exit() -> None:
    leave()
    if _exit_hook is not None:
        _exit_hook()


def leave() -> None:
    """Leave together (a bounded barrier; a dead peer only costs its time-out), destroy the
    groups, so no rank tears its connections down under a peer that still uses them, and
    let go of conveyor's references to them, so that they are freed and their worker
    threads joined now, while the interpreter is alive (``_groups.py`` says why), also
    when the script destroyed the default group itself.

    After a step failed here, or stopped for another rank's failure, this process skips
    the barrier and breaks the groups instead (:func:`conveyor._failure.close`), so that
    no worker thread is left blocked on a peer and the process ends at once."""
    failed = failure.close()
    if dist.is_initialized():
        if not failed:
            with contextlib.suppress(Exception):
                work = dist.barrier(async_op=True)
                if work is not None:
                    work.wait(datetime.timedelta(seconds=min(_exit_timeout, 2.0)))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    release_all()
