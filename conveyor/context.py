"""Process context: which rank this is, its pipeline position and device."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from conveyor.errors import ConfigError

DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Context:
    """Where this process sits: global rank, pipeline rank, data-parallel rank, device.

    ``distributed`` is False for the world of one process, which then runs the stages of
    all ``pp_size`` pipeline ranks itself. ``timeout`` (seconds) bounds every wait on a
    peer rank.
    """

    rank: int
    world_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    backend: str | None
    distributed: bool
    timeout: float

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this process's replica."""
        return pp_rank


_current: Context | None = None


def _timeout_from(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get("CONVEYOR_TIMEOUT", DEFAULT_TIMEOUT))


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or ``conveyor launch``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init(
    pp: int | None = None, dp: int = 1, backend: str | None = None, timeout: float | None = None
) -> Context:
    """Set up conveyor for this process and return its :class:`Context`.

    Reads the ``torchrun`` environment (or an already initialised default process group).
    ``pp`` defaults to world_size // dp; ``backend`` to ``nccl`` with CUDA, else ``gloo``.
    Without a distributed environment this is a world of one process that runs all ``pp``
    pipeline ranks itself. ``timeout`` (seconds, default ``$CONVEYOR_TIMEOUT`` or 300)
    bounds every wait on another rank, so a dead or stalled peer raises instead of hanging.
    """
    global _current
    seconds = _timeout_from(timeout)
    if dp < 1 or (pp is not None and pp < 1):
        raise ConfigError(f"pp and dp must be >= 1, got pp={pp}, dp={dp}")
    distributed = dist.is_available() and (dist.is_initialized() or in_torchrun())
    if not distributed:
        if dp != 1:
            raise ConfigError(
                f"dp={dp} needs {dp} processes; launch with `conveyor launch --nproc-per-node "
                f"{(pp or 1) * dp} script.py` (dp > 1 also needs data-parallel support)"
            )
        _current = Context(0, 1, 0, pp or 1, 0, 1, torch.device("cpu"), None, False, seconds)
        return _current
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
        # torch 2.13's gloo can abort at interpreter exit when the group is never destroyed.
        atexit.register(_destroy)
    backend = str(dist.get_backend())
    world, rank = dist.get_world_size(), dist.get_rank()
    pp = world // dp if pp is None else pp
    if pp * dp != world:
        raise ConfigError(
            f"world size {world} is not pp x dp = {pp} x {dp}; launch {pp * dp} processes or "
            f"change pp/dp so that pp * dp == {world}"
        )
    if dp != 1:
        raise ConfigError("dp > 1 (data x pipeline parallelism) is not supported yet; use dp=1")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    _current = Context(rank, world, rank, pp, 0, dp, device, backend, True, seconds)
    return _current


def _destroy() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def current() -> Context:
    """The context of the last :func:`init`, initialising with defaults if there is none."""
    return _current if _current is not None else init()
