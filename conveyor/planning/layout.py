"""How a training run is laid out on a cluster: :class:`Layout`, checked when made."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from conveyor.errors import ConfigError
from conveyor.planning.memory import OPTIMIZERS, RECOMPUTE, Setting
from conveyor.planning.model_count import ATTENTIONS, DTYPES
from conveyor.schedules import SCHEDULE_NAMES

SPLITS = ("even", "ends")
"""Named splits of the decoder layers: ``"even"`` (as many layers on every stage, the
embeddings added to the first and the head to the last: Megatron-LM's default) and
``"ends"`` (the embeddings and the head count as one layer each, so the first and last
stages hold one layer fewer: Llama 3's and the Zero Bubble paper's)."""

OVERLAPS = ("stage", "backward", "none")
"""When a stage's gradient reduction runs (see :class:`Layout` ``dp_overlap``)."""


@dataclass(frozen=True)
class Layout:
    """One way to run a model on ``pp * tp * cp * dp`` GPUs.

    Ranks are numbered as :func:`conveyor.init` numbers them, ``rank = ((dp_rank * pp +
    pp_rank) * cp + cp_rank) * tp + tp_rank``, and packed onto nodes in order
    (:meth:`group`): a tensor-parallel group is ``tp`` consecutive ranks, a
    context-parallel group ``cp`` ranks ``tp`` apart, a pipeline ``pp`` ranks ``cp * tp``
    apart, a data-parallel group ``dp`` ranks ``pp * cp * tp`` apart. Expert-parallel
    groups are consecutive data-parallel ranks (``dp_rank = edp_rank * ep + ep_rank``).

    Attributes:
        pp: Pipeline ranks.
        tp: Tensor-parallel ranks.
        dp: Data-parallel replicas (FSDP shards with ``fsdp``).
        cp: Context-parallel ranks: each sequence cut into ``2 * cp`` chunks, two per
            rank, attention by a ring of key/value blocks over them.
        fsdp: Shard parameters, gradients and optimizer state over ``dp``: ``True``
            gathers a rank's weights once per step (conveyor's default, torchtitan's with
            a pipeline), ``"reshard"`` for every use and frees them after it (FSDP's
            default without a pipeline).
        ep: Expert-parallel ranks (a divisor of ``dp``).
        schedule: A conveyor schedule name (``conveyor.schedules.SCHEDULE_NAMES``).
        chunks: Stages per pipeline rank.
        microbatch_cap: ``zb-auto``'s cap on micro-batches in flight (default: ``pp``).
        microbatch_size: Sequences per micro-batch.
        global_batch: Sequences per step over all replicas.
        seq: Tokens per sequence.
        recompute: ``False``; ``True``: each stage keeps its input from F until B and
            runs its forward again at B (conveyor's runtime); ``"layer"``: each decoder
            layer does (Megatron's full recompute, torchtitan's full activation
            checkpointing); ``"selective"``: the attention kernels do (Megatron's).
        dtype: ``"bf16"``/``"fp16"`` (mixed precision: fp32 master weights, gradients and
            optimizer state) or ``"fp32"``.
        optimizer: ``"adamw"``, ``"adam"`` (two fp32 states per parameter) or ``"sgd"``
            (none).
        balance: Decoder layers per stage (``pp * chunks`` numbers), one of
            :data:`SPLITS`, or None: the units' time balanced
            (:func:`~conveyor.planning.prediction.time_balance`).
        distributed_optimizer: Master weights and optimizer state sharded over ``dp``
            (ZeRO-1, Megatron's distributed optimizer): gradients reduce-scattered,
            weights all-gathered after the step.
        sequence_parallel: With ``tp``: norms, dropouts and residuals on a tp-th of the
            sequence each (their activations split too); without it they are on every
            tp rank.
        dp_overlap: When a stage's gradient reduction runs: ``"stage"`` once its last
            backward has ended (conveyor's runtime), ``"backward"`` beside that backward
            (DDP's, FSDP's and Megatron's buckets), ``"none"`` after the whole step.
        p2p_overlap: Pipeline sends run beside the compute (conveyor's runtime); False:
            a rank waits for each of its sends (Megatron-LM's point-to-point calls).
        attention: ``"flash"``: the fused kernel (FlashAttention; attention a model
            writes by hand too); ``"math"``: as written, the scores materialized and
            saved (a framework without a fused kernel).
    """

    pp: int
    _: KW_ONLY
    tp: int = 1
    dp: int = 1
    cp: int = 1
    fsdp: bool | str = False
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    microbatch_cap: int | None = None
    microbatch_size: int = 1
    global_batch: int
    seq: int
    recompute: bool | str = False
    dtype: str = "bf16"
    optimizer: str = "adamw"
    balance: tuple[int, ...] | str | None = None
    distributed_optimizer: bool = False
    sequence_parallel: bool = True
    dp_overlap: str = "stage"
    p2p_overlap: bool = True
    attention: str = "flash"

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "cp", "ep", "chunks", "microbatch_size", "global_batch"):
            _positive(name, getattr(self, name))
        _positive("seq", self.seq)
        if self.dp % self.ep:
            raise ConfigError(
                f"Layout ep={self.ep} must divide dp={self.dp}: experts are spread over the "
                "data-parallel ranks"
            )
        if self.global_batch % (self.dp * self.microbatch_size):
            raise ConfigError(
                f"Layout global_batch={self.global_batch} is not a whole number of micro-batches "
                f"of {self.microbatch_size} on each of dp={self.dp} replicas; make it a "
                f"multiple of {self.dp * self.microbatch_size}"
            )
        if self.seq % (2 * self.cp) and self.cp > 1:
            raise ConfigError(
                f"Layout cp={self.cp} cuts each sequence into {2 * self.cp} equal chunks, but "
                f"seq={self.seq} is not a multiple of {2 * self.cp}; pad the sequences"
            )
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"Layout schedule {self.schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}"
            )
        _one_of("dtype", self.dtype, tuple(DTYPES))
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("fsdp", self.fsdp, (False, True, "reshard"))
        _one_of("recompute", self.recompute, RECOMPUTE)
        _one_of("dp_overlap", self.dp_overlap, OVERLAPS)
        _one_of("attention", self.attention, ATTENTIONS)
        if self.fsdp and self.distributed_optimizer:
            raise ConfigError(
                "Layout fsdp already shards the optimizer state; drop distributed_optimizer"
            )
        if isinstance(self.balance, str):
            _one_of("balance", self.balance, SPLITS)
        elif self.balance is not None:
            sizes = tuple(self.balance)
            if len(sizes) != self.pp * self.chunks or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes
            ):
                raise ConfigError(
                    f"Layout balance {list(sizes)} must give the decoder layers of each of the "
                    f"{self.pp * self.chunks} stages (pp x chunks) as integers >= 0"
                )
            object.__setattr__(self, "balance", sizes)

    def group(self, axis: str) -> tuple[int, int]:
        """One group of the mesh along ``axis``: (its ranks, how many ranks apart they are).

        Args:
            axis: ``"tp"``, ``"cp"``, ``"pp"`` (a pipeline), ``"dp"`` (the replicas of one
                rank), ``"ep"`` (the ranks that split the experts among them) or ``"edp"``
                (the replicas of one rank's experts, which reduce their gradients).
        """
        stage = self.pp * self.cp * self.tp  # a pipeline's ranks: one replica
        return {
            "tp": (self.tp, 1),
            "cp": (self.cp, self.tp),
            "pp": (self.pp, self.cp * self.tp),
            "dp": (self.dp, stage),
            "ep": (self.ep, stage),
            "edp": (self.dp // self.ep, self.ep * stage),
        }[axis]

    @property
    def gpus(self) -> int:
        """GPUs the layout runs on: ``pp * tp * cp * dp``."""
        return self.pp * self.tp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each pipeline."""
        return self.global_batch // (self.dp * self.microbatch_size)

    def setting(self, buffer: float = 0.0) -> Setting:
        """What the memory model and the step's tail take from this layout (gradients are
        reduced over ``dp * cp``: the cp ranks of a replica hold the same weights)."""
        return Setting(
            dp=self.dp * self.cp,
            ep=self.ep,
            fsdp=self.fsdp,
            distributed_optimizer=self.distributed_optimizer,
            optimizer=self.optimizer,
            precision="fp32" if self.dtype == "fp32" else "mixed",
            recompute=self.recompute,
            buffer=buffer,
            dp_overlap=self.dp_overlap,
        )


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Layout {name} must be an integer >= 1, got {value!r}")


def _one_of(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise ConfigError(
            f"Layout {name} must be one of {', '.join(map(str, allowed))}, got {value!r}"
        )
