"""Process context: which rank this is, its pipeline position and device."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from conveyor.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Context:
    """Where this process sits: global rank, pipeline rank, data-parallel rank, device.

    ``distributed`` is False for the world of one process, which then runs the stages of
    all ``pp_size`` pipeline ranks itself. ``timeout`` (seconds) bounds every wait on a
    peer rank.

    Global rank = ``dp_rank * pp_size + pp_rank``: consecutive ranks form one pipeline
    replica. ``pp_group`` holds this replica's ranks and ``dp_group`` the ranks with this
    ``pp_rank`` in every replica (both ``None`` with ``dp_size == 1``: the pipeline is then
    the whole default group and there is nothing to average). ``mesh`` is the
    ``(dp, pp)`` :class:`~torch.distributed.device_mesh.DeviceMesh` they come from.
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
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    # Whether pp was chosen (by init(pp=...) or the world size): in a one-process world
    # without it, a Pipeline runs as many ranks as its balance or annotations describe.
    pp_explicit: bool = field(default=True, repr=False, compare=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this process's replica."""
        return self.dp_rank * self.pp_size + pp_rank


_current: Context | None = None
_exit_hook = False
_exit_wait = DEFAULT_TIMEOUT  # the last init's time-out, for the barrier at exit


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
    pipeline ranks itself. With ``dp > 1`` the world is ``dp`` pipeline replicas of ``pp``
    consecutive ranks each; every replica trains on its own shard of the batch and
    gradients are averaged over the replicas. ``timeout`` (seconds, default
    ``$CONVEYOR_TIMEOUT`` or 300) bounds every wait on another rank, so a dead or stalled
    peer raises instead of hanging.
    """
    global _current
    seconds = _timeout_from(timeout)
    if dp < 1 or (pp is not None and pp < 1):
        raise ConfigError(f"pp and dp must be >= 1, got pp={pp}, dp={dp}")
    distributed = dist.is_available() and (dist.is_initialized() or in_torchrun())
    if not distributed:
        if dp != 1:
            raise ConfigError(
                f"dp={dp} needs pp x dp processes; launch with `conveyor launch "
                f"--nproc-per-node {(pp or 1) * dp} script.py`, or use dp=1 in one process"
            )
        _current = Context(
            0, 1, 0, pp or 1, 0, 1, torch.device("cpu"), None, False, seconds,
            pp_explicit=pp is not None,
        )
        return _current
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
    # torch 2.13's gloo can abort at interpreter exit ("terminate called without an active
    # exception") when the group is never destroyed: destroy it at exit, whoever made it.
    global _exit_hook, _exit_wait
    _exit_wait = seconds
    if not _exit_hook:
        atexit.register(_destroy)
        _exit_hook = True
    backend = str(dist.get_backend())
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp is None and world % dp:
        raise ConfigError(
            f"dp={dp} does not divide the world size {world}; launch a multiple of {dp} "
            f"processes or pick a dp that divides {world}"
        )
    pp = world // dp if pp is None else pp
    if pp * dp != world:
        raise ConfigError(
            f"world size {world} is not pp x dp = {pp} x {dp}; launch {pp * dp} processes or "
            f"change pp/dp so that pp * dp == {world}"
        )
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if dp == 1:
        _current = Context(rank, world, rank, pp, 0, 1, device, backend, True, seconds)
        return _current
    mesh = _device_mesh(device.type, backend, dp, pp, seconds)
    _current = Context(
        rank,
        world,
        rank % pp,
        pp,
        rank // pp,
        dp,
        device,
        backend,
        True,
        seconds,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        mesh=mesh,
    )
    return _current


def _device_mesh(device_type: str, backend: str, dp: int, pp: int, seconds: float) -> DeviceMesh:
    """The ``(dp, pp)`` mesh: rank = dp_rank * pp + pp_rank; its groups get our time-out.

    Collective over the whole world (every rank creates every group).
    """
    from torch.distributed.device_mesh import init_device_mesh

    kwargs: dict[str, Any] = {}
    options = _group_options(backend, seconds)
    if options is not None and "backend_override" in inspect.signature(init_device_mesh).parameters:
        kwargs["backend_override"] = {"dp": (backend, options[0]), "pp": (backend, options[1])}
    # Without backend_override (torch < 2.6) the groups keep torch's default time-out.
    return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"), **kwargs)


def _group_options(backend: str, seconds: float) -> tuple[Any, Any] | None:
    """Fresh backend options (one per mesh dimension) carrying a ``seconds`` time-out."""
    if backend == "gloo":
        make: Any = dist.ProcessGroupGloo._Options  # type: ignore[attr-defined]
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        make = dist.ProcessGroupNCCL.Options
    else:
        return None
    pair = (make(), make())
    for options in pair:
        options._timeout = datetime.timedelta(seconds=seconds)
    return pair


def _destroy() -> None:
    """At exit: leave together (a bounded barrier; a dead peer only costs its time-out),
    then destroy the group, so no rank tears its connections down under a peer that still
    uses them."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        work = dist.barrier(async_op=True)
        if work is not None:
            work.wait(datetime.timedelta(seconds=min(_exit_wait, 2.0)))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def current() -> Context:
    """The context of the last :func:`init`, initialising with defaults if there is none."""
    return _current if _current is not None else init()
