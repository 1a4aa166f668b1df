"""How a training run is laid out on a cluster: :class:`Layout`, checked when made."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from conveyor.errors import ConfigError
from conveyor.planning.model_count import DTYPES
from conveyor.schedules import SCHEDULE_NAMES

OPTIMIZERS = ("adamw", "adam", "sgd")
"""The optimizers whose state a layout's memory counts."""


@dataclass(frozen=True)
class Layout:
    """One way to run a model on ``pp * tp * dp`` GPUs.

    Ranks are numbered as :func:`conveyor.init` numbers them, ``rank = (dp_rank * pp +
    pp_rank) * tp + tp_rank``, and packed onto nodes in order (:meth:`group`): a
    tensor-parallel group is ``tp`` consecutive ranks, a pipeline ``pp`` ranks ``tp``
    apart, a data-parallel group ``dp`` ranks ``pp * tp`` apart. Expert-parallel groups are
    consecutive data-parallel ranks (``dp_rank = edp_rank * ep + ep_rank``).

    Attributes:
        pp: Pipeline ranks.
        tp: Tensor-parallel ranks (with sequence parallelism: activations split too).
        dp: Data-parallel replicas (FSDP shards with ``fsdp``).
        fsdp: Shard parameters, gradients and optimizer state over ``dp``.
        ep: Expert-parallel ranks (a divisor of ``dp``).
        schedule: A conveyor schedule name (``conveyor.schedules.SCHEDULE_NAMES``).
        chunks: Stages per pipeline rank.
        microbatch_cap: ``zb-auto``'s cap on micro-batches in flight (default: ``pp``).
        microbatch_size: Sequences per micro-batch.
        global_batch: Sequences per step over all replicas.
        seq: Tokens per sequence.
        recompute: Keep only each layer's input from F until B and run F again at B.
        dtype: ``"bf16"``/``"fp16"`` (mixed precision: fp32 master weights, gradients and
            optimizer state) or ``"fp32"``.
        optimizer: ``"adamw"``, ``"adam"`` (two fp32 states per parameter) or ``"sgd"``
            (none).
    """

    pp: int
    _: KW_ONLY
    tp: int = 1
    dp: int = 1
    fsdp: bool = False
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    microbatch_cap: int | None = None
    microbatch_size: int = 1
    global_batch: int
    seq: int
    recompute: bool = False
    dtype: str = "bf16"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "ep", "chunks", "microbatch_size", "global_batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Layout {name} must be an integer >= 1, got {value!r}")
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
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"Layout schedule {self.schedule!r} is not one of {', '.join(SCHEDULE_NAMES)}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"Layout dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"Layout optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )

    def group(self, axis: str) -> tuple[int, int]:
        """One group of the mesh along ``axis``: (its ranks, how many ranks apart they are).

        Args:
            axis: ``"tp"``, ``"pp"`` (a pipeline), ``"dp"`` (the replicas of one rank),
                ``"ep"`` (the ranks that split the experts among them) or ``"edp"`` (the
                replicas of one rank's experts, which reduce their gradients).
        """
        stage = self.pp * self.tp  # a pipeline's ranks: one replica
        return {
            "tp": (self.tp, 1),
            "pp": (self.pp, self.tp),
            "dp": (self.dp, stage),
            "ep": (self.ep, stage),
            "edp": (self.dp // self.ep, self.ep * stage),
        }[axis]

    @property
    def gpus(self) -> int:
        """GPUs the layout runs on: ``pp * tp * dp``."""
        return self.pp * self.tp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each pipeline."""
        return self.global_batch // (self.dp * self.microbatch_size)
