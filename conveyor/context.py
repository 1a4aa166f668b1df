"""Process context: which rank this is, its pipeline position and device."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import conveyor._failure as failure
from conveyor._groups import Held, forget_mesh_groups, held_groups
from conveyor._mesh import backend_timeout as backend_timeout  # Lightning imports it here
from conveyor._mesh import device_mesh, local_rank
from conveyor._world import check_sizes, join, pipeline_ranks, timeout_from
from conveyor.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT = 300.0
"""Seconds any wait on a peer rank may take when neither ``init(timeout=...)`` nor
``$CONVEYOR_TIMEOUT`` says otherwise."""


@dataclass(frozen=True)
class Context:
    """Where this process sits: its ranks in the world and in the mesh, and its device.

    Made by :func:`init`. Global rank = ``((dp_rank * pp_size + pp_rank) * cp_size +
    cp_rank) * tp_size + tp_rank``: tensor-parallel groups are consecutive ranks, then
    context-parallel groups, and with ``tp_size == cp_size == 1`` consecutive ranks form
    one pipeline replica. The cp ranks of a pipeline rank hold the same stages and each
    trains on its share of every sequence: for the gradients they are replicas like the
    data-parallel ones, and the step's replicas are ``dp_size * cp_size``
    (:attr:`replica_group`). With expert parallelism (``ep_size > 1``)
    the data-parallel rank splits as ``dp_rank = edp_rank * ep_size + ep_rank``: an
    expert-parallel group is ``ep_size`` consecutive replicas (torchtitan's convention, EP
    borrows from the data-parallel dimension). The process groups (:attr:`pp_group`,
    :attr:`dp_group`, :attr:`tp_group`, :attr:`ep_group`, :attr:`expert_replica_group`)
    and the :attr:`mesh` are ``None`` in a world of one process.

    Attributes:
        rank: Global rank, ``0 .. world_size - 1``.
        world_size: Number of processes.
        pp_rank: Pipeline rank, ``0 .. pp_size - 1``.
        pp_size: Pipeline ranks per replica.
        dp_rank: Data-parallel replica, ``0 .. dp_size - 1``.
        dp_size: Data-parallel replicas.
        device: This process's device: ``cuda:<local rank>`` with NCCL, else CPU.
        backend: The process-group backend (``"nccl"``, ``"gloo"``), None in a world of
            one process.
        distributed: False for the world of one process, which then runs the stages of
            all ``pp_size`` pipeline ranks itself.
        timeout: Seconds any wait on a peer rank may take before it raises.
        pp_explicit: Whether ``pp_size`` was chosen (by ``init(pp=...)`` or the world
            size); in a one-process world without it, a Pipeline runs as many ranks as
            its balance or annotations describe.
        tp_rank: Tensor-parallel rank, ``0 .. tp_size - 1``.
        tp_size: Processes sharing each pipeline rank's layers.
        ep_rank: Expert-parallel rank, ``dp_rank % ep_size``: which share of every expert
            collection this process holds.
        ep_size: Processes sharing each expert collection (they are data-parallel ranks
            of the same ``pp_rank`` and ``tp_rank``).
        cp_rank: Context-parallel rank, ``0 .. cp_size - 1``: which share of each
            sequence this process holds.
        cp_size: Processes sharing each sequence (context parallelism; in a world of one
            process, the shares it computes side by side).
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
    # Whether pp was chosen (by init(pp=...) or the world size): in a one-process world
    # without it, a Pipeline runs as many ranks as its balance or annotations describe.
    pp_explicit: bool = field(default=True, repr=False, compare=False)
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    # The mesh and its groups, through handles that the exit hook releases (_groups.py).
    _mesh: Held[DeviceMesh] | None = field(default=None, repr=False, compare=False)
    _groups: Held[dict[str, dist.ProcessGroup]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def mesh(self) -> DeviceMesh | None:
        """The ``(dp, pp, tp)`` device mesh (None in a world of one process).

        With ``ep_size > 1`` its dimensions are ``(edp, ep, pp, tp)``, and ``"dp"`` is
        their first two flattened: ``mesh["dp"]``, ``mesh["pp"]``, ``mesh["tp"]`` work
        as without expert parallelism, and ``mesh["ep"]`` is the expert-parallel
        sub-mesh, ``mesh["edp"]`` the replicas holding the same experts.

        With ``cp_size > 1`` a ``"cp"`` dimension stands between ``"pp"`` and ``"tp"``,
        and ``mesh["dp_cp"]`` is the data- and context-parallel ranks flattened (the
        step's replicas: FSDP shards over it).
        """
        return self._mesh.get() if self._mesh is not None else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This process's pipeline: the ranks with its ``dp_rank`` and ``tp_rank``."""
        return self._group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks with this process's ``pp_rank`` and ``tp_rank`` in every replica."""
        return self._group("dp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks sharing this process's sequences (its context-parallel group): the
        ``cp_size`` ranks with its ``dp_rank``, ``pp_rank`` and ``tp_rank``. None when
        ``cp_size == 1``."""
        return self._group("cp") if self.cp_size > 1 else None

    @property
    def replicas(self) -> int:
        """The step's replicas: ``dp_size * cp_size`` (module doc of the class)."""
        return self.dp_size * self.cp_size

    @property
    def replica_rank(self) -> int:
        """This process's index among the step's replicas: ``dp_rank * cp_size +
        cp_rank``."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks whose gradients and losses add up with this process's: every
        data-parallel replica's and context-parallel rank's with its ``pp_rank`` and
        ``tp_rank`` (:attr:`dp_group` when ``cp_size == 1``)."""
        return self._group("dp_cp") if self.cp_size > 1 else self.dp_group

    @property
    def replica_mesh(self) -> DeviceMesh | None:
        """The sub-mesh of :attr:`replica_group` (what FSDP shards over)."""
        mesh = self.mesh
        if mesh is None:
            return None
        return mesh["dp_cp"] if self.cp_size > 1 else mesh["dp"]

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The ranks sharing this process's layers' shards (its tensor-parallel group)."""
        return self._group("tp")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks sharing this process's expert collections (its expert-parallel
        group): ``ep_size`` data-parallel ranks. None when ``ep_size == 1``."""
        return self._group("ep") if self.ep_size > 1 else None

    @property
    def expert_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts as this process: the ``dp_size / ep_size``
        data-parallel ranks with its ``ep_rank`` (the whole :attr:`dp_group` when
        ``ep_size == 1``), with every context-parallel rank of them. Expert gradients are
        summed over it."""
        if self.ep_size == 1:
            return self.replica_group
        return self._group("edp_cp") if self.cp_size > 1 else self._group("edp")

    def _group(self, name: str) -> dist.ProcessGroup | None:
        """The mesh's ``name`` (``"pp"``, ``"dp"``, ``"tp"``, ``"ep"``, ``"edp"``) process
        group, or None."""
        return self._groups.get()[name] if self._groups is not None else None

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this process's pipeline.

        Args:
            pp_rank: A pipeline rank, ``0 .. pp_size - 1``.

        Returns:
            The global rank with this process's ``dp_rank``, ``cp_rank`` and ``tp_rank``.
        """
        return self.rank_at(self.dp_rank, pp_rank, self.tp_rank)

    def rank_at(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int | None = None) -> int:
        """Global rank of the process at (``dp_rank``, ``pp_rank``, ``cp_rank``,
        ``tp_rank``) of the mesh.

        Args:
            dp_rank: Data-parallel replica.
            pp_rank: Pipeline rank.
            tp_rank: Tensor-parallel rank.
            cp_rank: Context-parallel rank (default: this process's).

        Returns:
            ``((dp_rank * pp_size + pp_rank) * cp_size + cp_rank) * tp_size + tp_rank``.
        """
        cp = self.cp_rank if cp_rank is None else cp_rank
        return ((dp_rank * self.pp_size + pp_rank) * self.cp_size + cp) * self.tp_size + tp_rank


_current: Context | None = None


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or ``conveyor launch``).

    Returns:
        True when ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are all set.
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init(
    pp: int | None = None,
    dp: int = 1,
    tp: int = 1,
    ep: int = 1,
    backend: str | None = None,
    timeout: float | None = None,
    cp: int = 1,
) -> Context:
    """Set up conveyor for this process and return its :class:`Context`.

    Reads the ``torchrun`` environment (or an already initialised default process group)
    and creates the default process group and the ``(dp, pp, tp)`` device mesh; with NCCL
    it also selects this process's GPU (``LOCAL_RANK``). Without a distributed
    environment this is a world of one process that runs all ``pp`` pipeline ranks
    itself. In a distributed world every process must call it (it is a collective).

    Args:
        pp: Pipeline ranks per replica. Default: ``world_size // (dp * tp)`` (1 in a
            world of one process).
        dp: Data-parallel replicas: every replica trains on its own shard of the batch
            and gradients are averaged (or, with ``Pipeline(fsdp=True)``,
            reduce-scattered) over the replicas.
        tp: Tensor-parallel processes per pipeline rank, sharing its layers' matrices
            (``Pipeline(tp_plan=...)``).
        ep: Expert-parallel processes: each expert collection is split over ``ep``
            data-parallel ranks of the same pipeline and tensor-parallel rank (``ep``
            divides ``dp``), and tokens reach their experts by all-to-all
            (``Pipeline(ep_plan=...)``).
        cp: Context-parallel processes per pipeline rank: each micro-batch's sequence is
            cut into ``2 * cp`` chunks, each of these processes holds two, and attention
            covers the whole sequence by passing keys and values around them
            (:mod:`conveyor.context_parallel`). In a world of one process, the process
            computes every share itself.
        backend: The process-group backend. Default: ``"nccl"`` with CUDA, else
            ``"gloo"``. When a default process group exists, its own; asking for
            another raises.
        timeout: Seconds any wait on another rank may take, so that a dead or stalled
            peer raises instead of hanging. Default: ``$CONVEYOR_TIMEOUT``, else 300.

    Returns:
        This process's context, also kept for :func:`current`.

    Raises:
        ConfigError: For a ``pp``, ``dp``, ``tp`` or ``ep`` that is not an int >= 1, an
            ``ep`` that does not divide ``dp``, a timeout that is not a finite number > 0,
            ``dp`` or ``tp`` above 1 in a world of one process, a world size that is
            not ``pp * dp * tp``, or a ``backend`` other than the existing default
            process group's.
    """
    global _current
    seconds = timeout_from(timeout, DEFAULT_TIMEOUT)
    check_sizes(pp, dp, tp, ep, cp)
    distributed = dist.is_available() and (dist.is_initialized() or in_torchrun())
    if not distributed:
        if dp != 1 or tp != 1:
            raise ConfigError(
                f"dp={dp} x tp={tp} needs pp x dp x tp processes; launch with `conveyor "
                f"launch --nproc-per-node {(pp or 1) * dp * tp} script.py`, or use dp=1 and "
                f"tp=1 in one process"
            )
        _current = Context(0, 1, 0, pp or 1, 0, 1, torch.device("cpu"), None, False, seconds,
                           pp_explicit=pp is not None, cp_size=cp)  # fmt: skip
        return _current
    backend = join(backend, seconds, _forget_at_exit)
    world, rank = dist.get_world_size(), dist.get_rank()
    pp = pipeline_ranks(world, pp, dp, tp, cp)
    if backend == "nccl":
        local = local_rank()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    mesh = device_mesh(device.type, backend, dp, pp, tp, seconds, ep, cp)
    names = ["dp", "pp", "tp", *(["ep", "edp"] if ep > 1 else [])]
    names += ["cp", "dp_cp", *(["edp_cp"] if ep > 1 else [])] if cp > 1 else []
    dp_rank = rank // (pp * cp * tp)
    _current = Context(
        rank,
        world,
        (rank // (cp * tp)) % pp,
        pp,
        dp_rank,
        dp,
        device,
        backend,
        True,
        seconds,
        tp_rank=rank % tp,
        tp_size=tp,
        ep_rank=dp_rank % ep,
        ep_size=ep,
        cp_rank=(rank // tp) % cp,
        cp_size=cp,
        _mesh=Held(mesh, forget_mesh_groups),
        _groups=Held({name: mesh[name].get_group() for name in names}),
    )
    failure.connect(rank, seconds, _all_groups)
    return _current


def _all_groups() -> list[dist.ProcessGroup | None]:
    """The default group and every group conveyor holds: what the failure board breaks
    when this process stops for another rank's failure."""
    return [dist.group.WORLD, *held_groups()]


def _forget_at_exit() -> None:
    """After :func:`conveyor._world.leave` at exit: no context left, the groups freed."""
    global _current
    _current = None
    gc.collect()


def current() -> Context:
    """The context of the last :func:`init`, initialising with defaults if there is none.

    Returns:
        The current context.

    Raises:
        ConfigError: As :func:`init` does, when it has to initialise.
    """
    return _current if _current is not None else init()


def forget() -> None:
    """Forget this process's context, leaving any process group as it is: the next
    :func:`current` or :func:`init` makes a new one, as in a fresh script (a test suite or
    a notebook running several scripts' worth in one process)."""
    global _current
    _current = None
