"""Making the process groups' device mesh, and the time-outs and GPU each process uses.

:func:`conveyor.context.init` calls these once the default process group exists.
"""

from __future__ import annotations

import datetime
import inspect
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def device_mesh(
    device_type: str,
    backend: str,
    dp: int,
    pp: int,
    tp: int,
    seconds: float,
    ep: int = 1,
    cp: int = 1,
) -> DeviceMesh:
    """The ``(dp, pp, tp)`` mesh: rank = (dp_rank * pp + pp_rank) * tp + tp_rank; its groups
    get our time-out.

    With ``ep > 1`` the mesh is ``(edp, ep, pp, tp)`` with ``dp_rank = edp_rank * ep +
    ep_rank`` (the same global ranks), and ``"dp"`` is ``("edp", "ep")`` flattened, so
    that ``mesh["dp"]`` is the data-parallel sub-mesh as before. With ``cp > 1`` a ``"cp"``
    dimension stands before ``"tp"`` (rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) *
    tp + tp_rank), and the data- and context-parallel dimensions flattened are
    ``"dp_cp"`` (with ``ep``, also ``"edp_cp"``: the replicas of an expert shard).

    Collective over the whole world (every rank creates every group).
    """
    from torch.distributed.device_mesh import init_device_mesh

    names: tuple[str, ...] = ("dp", "pp", "tp")
    shape: tuple[int, ...] = (dp, pp, tp)
    if ep > 1:
        names, shape = ("edp", "ep", "pp", "tp"), (dp // ep, ep, pp, tp)
    if cp > 1:
        names, shape = (*names[:-1], "cp", "tp"), (*shape[:-1], cp, tp)
    kwargs: dict[str, Any] = {}
    options = group_options(backend, backend_timeout(backend, seconds), len(names) + 3)
    if options is not None and "backend_override" in inspect.signature(init_device_mesh).parameters:
        kwargs["backend_override"] = {
            name: (backend, option) for name, option in zip(names, options, strict=False)
        }
    # Without backend_override (torch < 2.6) the groups keep torch's default time-out.
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, **kwargs)
    flats: list[tuple[tuple[str, ...], str]] = [(("edp", "ep"), "dp")] if ep > 1 else []
    if cp > 1:
        dims: tuple[str, ...] = ("edp", "ep", "cp") if ep > 1 else ("dp", "cp")
        flats += [(dims, "dp_cp"), *([(("edp", "cp"), "edp_cp")] if ep > 1 else [])]
    for k, (dims, name) in enumerate(flats):
        flat = (backend, options[len(names) + k]) if options is not None else None
        mesh[dims]._flatten(name, backend_override=flat)
    return mesh


def backend_timeout(backend: str, seconds: float) -> float:
    """The process groups' own time-out for conveyor's time-out of ``seconds``.

    On NCCL, waits are stream-ordered and conveyor's watchdog names a stalled transfer
    after ``seconds`` (:mod:`conveyor.runtime.watchdog`); NCCL's watchdog, which ends the
    process without naming the action, gets longer so that ours speaks first.

    Args:
        backend: The process-group backend, e.g. ``"nccl"`` or ``"gloo"``.
        seconds: conveyor's time-out.

    Returns:
        ``seconds + max(30, seconds / 4)`` for NCCL, else ``seconds``.
    """
    return seconds + max(30.0, seconds / 4) if backend == "nccl" else seconds


def local_rank() -> int:
    """This process's GPU: ``LOCAL_RANK``, else the global rank modulo the GPU count."""
    fallback = int(os.environ.get("RANK", "0")) % max(torch.cuda.device_count(), 1)
    return int(os.environ.get("LOCAL_RANK", fallback))


def group_options(backend: str, seconds: float, count: int) -> list[Any] | None:
    """Fresh backend options (one per mesh dimension) carrying a ``seconds`` time-out."""
    if backend == "gloo":
        make: Any = dist.ProcessGroupGloo._Options  # type: ignore[attr-defined]
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        make = dist.ProcessGroupNCCL.Options
    else:
        return None
    out = [make() for _ in range(count)]
    for options in out:
        options._timeout = datetime.timedelta(seconds=seconds)
    return out
