"""Context parallelism for one pipeline: how its cp ranks talk, where the model's attention
meets them, and the stage ends that cut each micro-batch (:func:`sequence_ends`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, fx, nn

from conveyor.context import Context
from conveyor.context_parallel import install, op
from conveyor.context_parallel.cut import IGNORE, Cut
from conveyor.context_parallel.ends import SequenceEnds, gather_over
from conveyor.context_parallel.rotation import Gathered, Ring, Rotation, Stacked
from conveyor.errors import ConfigError
from conveyor.losses import ModelTokenLoss, TokenCrossEntropy, output_field
from conveyor.runtime.step_sync import StepSync

STRATEGIES = ("ring", "all-gather")
"""How keys and values reach every cp rank: passed round a ring, or all-gathered."""


def rotation(ctx: Context, strategy: str) -> Rotation:
    """The cp ranks' :class:`~conveyor.context_parallel.rotation.Rotation` for ``ctx``
    and ``strategy`` (one of :data:`STRATEGIES`, checked with the Pipeline's keywords)."""
    if not ctx.distributed:
        return Stacked(ctx.cp_size)
    group = ctx.cp_group
    assert group is not None
    members = tuple(
        ctx.rank_at(ctx.dp_rank, ctx.pp_rank, ctx.tp_rank, r) for r in range(ctx.cp_size)
    )
    ring = Ring(ctx.cp_rank, members, group, ctx.timeout, stream_waits=ctx.device.type == "cuda")
    return ring if strategy == "ring" else Gathered(ring)


class ShiftedModelTokenLoss(ModelTokenLoss):
    """A transformers causal LM's own token loss (:class:`~conveyor.losses.ModelTokenLoss`)
    on labels already shifted over the whole sequence (given as ``shift_labels``), so a
    cp rank's share predicts, at its last token of a chunk, the first of the next."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, shifts=False)

    def __call__(self, output: Any, labels: Tensor) -> tuple[Tensor, Tensor]:
        """The share's summed token loss and its count."""
        logits = output if isinstance(output, Tensor) else output_field(output, "logits")
        total: Tensor = self.model.loss_function(
            logits, labels, vocab_size=self.model.config.vocab_size, num_items_in_batch=1,
            shift_labels=labels,
        )  # fmt: skip
        return total, self.count(labels)


@runtime_checkable
class Wrapping(Protocol):
    """A loss that applies another, ``loss_fn``, to the same targets (Lightning's
    accumulation scaling); ``around(other)`` is the same loss applied around ``other``."""

    loss_fn: Any

    def around(self, other: Any) -> Any:
        """This loss around ``other`` instead of ``loss_fn``."""


def unshifted(loss_fn: Any) -> tuple[Any, int | None]:
    """A ``loss_fn`` as it runs on a cp rank's share, and the ``ignore_index`` its targets
    are shifted with before the cut (None: not shifted): a next-token loss
    (``TokenCrossEntropy(shift=True)``, a causal LM's own token loss, either inside a
    :class:`Wrapping`) runs unshifted on targets shifted over the whole sequence, so the cut
    between two chunks loses no prediction."""
    if isinstance(loss_fn, TokenCrossEntropy) and loss_fn.shift:
        return TokenCrossEntropy(
            loss_fn.ignore_index, loss_fn.label_smoothing
        ), loss_fn.ignore_index
    if isinstance(loss_fn, ModelTokenLoss) and loss_fn.shifts:
        return ShiftedModelTokenLoss(loss_fn.model), IGNORE
    if isinstance(loss_fn, Wrapping):
        inner, ignore = unshifted(loss_fn.loss_fn)
        return (loss_fn.around(inner), ignore) if ignore is not None else (loss_fn, None)
    return loss_fn, None


class AttentionSync(StepSync):
    """Holds :class:`~conveyor.context_parallel.install.SDPAOverWholeSequence` over every
    step's actions (a model that is not a transformers model)."""

    def __init__(self, key: int) -> None:
        self.mode = install.SDPAOverWholeSequence(key)
        self.active = False

    def begin(self, program: Any) -> None:
        """Take over the step's ``scaled_dot_product_attention`` calls."""
        self.mode.__enter__()  # type: ignore[no-untyped-call]
        self.active = True

    def finish(self) -> None:
        """Give them back."""
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def abort(self) -> None:
        """Give them back after a failed step."""
        self.finish()


def _calls(stages: list[nn.Module]) -> Iterator[tuple[int, fx.Node]]:
    """(stage, node) for every function call of the stages' captured graphs."""
    for s, stage in enumerate(stages):
        graph = getattr(stage, "graph", None)
        for node in getattr(graph, "nodes", ()):
            if node.op == "call_function":
                yield s, node


def check_positions(stages: list[nn.Module], transformers: bool) -> None:
    """Refuse a captured model that makes its positions from its input's length
    (``torch.arange`` in its graph): under cp that length is this rank's share, so the
    positions would restart on every rank. transformers models are given their global
    ``position_ids`` (their own ``arange`` is then unused for positions).

    Raises:
        ConfigError: such a model, naming the stage and the node.
    """
    if transformers:
        return
    for s, node in _calls(stages):
        name = getattr(node.target, "__name__", str(node.target))
        if name.split(".")[0] == "arange":
            raise ConfigError(
                f"with cp > 1 each rank holds a share of every sequence, but stage {s} "
                f"makes positions with torch.arange ({node.name}) from its input's length, "
                f"which would restart on every rank; pass the positions as an input "
                f"([batch, sequence], cut with the rest), or train this model with cp=1"
            )


# Attention kernels a captured graph calls by name: under cp they would attend within this
# rank's share only (conveyor's own operator, ``conveyor::cp_attention``, is what should run).
LOCAL_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention",
                   "cudnn_attention", "flex_attention")  # fmt: skip


def check_attention(stages: list[nn.Module], model: str, transformers: bool) -> None:
    """Refuse a captured transformers model whose attention does not reach conveyor's
    implementation of transformers' attention interface: one that calls an attention
    kernel itself, or (no ``conveyor::cp_attention`` in any stage's graph) computes its
    scores by hand where its implementation is not ``sdpa`` (Falcon does both). Each rank
    would attend within its share of the sequence only, silently. ``model``: its class name.

    Raises:
        ConfigError: such a model, naming the stage and the call where there is one.
    """
    if not transformers or any(getattr(stage, "graph", None) is None for stage in stages):
        return  # a layer list: its calls are taken over during steps (AttentionSync)
    reached = False
    for s, node in _calls(stages):
        name = str(node.target)
        if "cp_attention" in name:
            reached = True
        elif any(kernel in name for kernel in LOCAL_ATTENTION):
            raise ConfigError(
                f"with cp > 1 each rank holds a share of every sequence, but stage {s} of "
                f"{model} calls {name} ({node.name}) itself, not through transformers' "
                f"attention interface, so it would attend within this rank's share only; "
                f"train this model with cp=1"
            )
    if not reached:
        raise ConfigError(
            f"with cp > 1 each rank holds a share of every sequence, but {model} computes its "
            f"attention without transformers' attention interface (no call reached "
            f"conveyor's), so it would attend within this rank's share only; train this "
            f"model with cp=1"
        )


@dataclasses.dataclass(frozen=True)
class Sequences:
    """What a pipeline's stage ends need for context parallelism (:func:`sequences`)."""

    cut: Cut
    gather: Any
    syncs: tuple[StepSync, ...]
    token_loss: ModelTokenLoss | None
    note: str = ""
    """A line for ``print(pipe)``: how the sequences are cut and attention moves."""
    model: str = "the model"
    """The model's class name, for errors."""

    def split(self, stages: list[nn.Module], inner: Callable[[list[nn.Module]], None]) -> None:
        """The model was cut into ``stages``: check it can take its share
        (:func:`check_positions`, :func:`check_attention`), then tell the ``inner`` ends."""
        check_positions(stages, self.cut.transformers)
        check_attention(stages, self.model, self.cut.transformers)
        inner(stages)

    def wrap(self, inner: Any) -> SequenceEnds:
        """The stage ends ``inner`` with each micro-batch cut."""
        return SequenceEnds(inner, self.cut, self.gather)


def sequences(
    model: nn.Module, ctx: Context, strategy: str, token_loss: ModelTokenLoss | None,
    shift_targets: int | None,
) -> Sequences:  # fmt: skip
    """Context parallelism for ``model`` on ``ctx`` (``ctx.cp_size > 1``): its attention
    installed (transformers' interface, else a function mode during steps), its cut.

    Args:
        model: The whole model.
        ctx: The process's context.
        strategy: ``"ring"`` or ``"all-gather"``.
        token_loss: The model's own token loss (``loss_fn=None`` on a transformers LM).
        shift_targets: The ``ignore_index`` a ``loss_fn``'s targets are shifted with.
    """
    rotated = rotation(ctx, strategy)
    key = op.register(rotated)
    transformers = install.install(model)
    cut = Cut(
        ctx.cp_size,
        tuple(rotated.ranks),
        key,
        transformers,
        shift_labels=token_loss is not None and token_loss.shifts,
        shift_targets=shift_targets,
    )
    gather = gather_over(ctx.cp_group, ctx.cp_size) if ctx.distributed and ctx.cp_group else None
    syncs: tuple[StepSync, ...] = () if transformers else (AttentionSync(key),)
    return Sequences(cut, gather, syncs, token_loss, describe(ctx, strategy), type(model).__name__)


def describe(ctx: Context, strategy: str) -> str:
    """:attr:`Sequences.note` for ``ctx`` and ``strategy``."""
    cp = ctx.cp_size
    where = (
        f"dp {ctx.dp_size} x cp {cp} replicas for gradients and losses"
        if ctx.distributed
        else "every share side by side in this process"
    )
    moves = "passed round a ring" if strategy == "ring" else "all-gathered"
    return (
        f"\ncontext parallel: cp {cp} ({where}); each sequence cut into {2 * cp} chunks, cp "
        f"rank i holding chunks i and {2 * cp - 1} - i; keys and values {moves}"
    )
