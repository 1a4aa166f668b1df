"""One step from a batch to its loss: the one owner of the step.

:meth:`Stepper.run` is the whole walk, for every mode: divide the batch into micro-batches
(:mod:`~conveyor.runtime.microbatch`), learn the first stage's header, scale the loss
(:mod:`~conveyor.runtime.step_loss`), run the engine with the step's syncs (reductions,
FSDP's gathers: :class:`~conveyor.runtime.step_sync.StepSync`), and combine the loss. The
engine below it runs the actions and calls nothing above itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from conveyor.context import Context
from conveyor.errors import PipelineError
from conveyor.runtime import microbatch
from conveyor.runtime.engine import Engine
from conveyor.runtime.microbatch import Counter, MicroBatches, Needs
from conveyor.runtime.step_grads import StepGradients
from conveyor.runtime.step_loss import (
    Combined,
    combine,
    global_rows,
    loss_scale,
    router_weight,
    sum_over_replicas,
)
from conveyor.runtime.step_state import Mode, StepRecord
from conveyor.runtime.step_sync import StepSync


class StepOutput(NamedTuple):
    """What a step gives back: its record, and (outside ``predict``) its loss."""

    record: StepRecord
    combined: Combined | None


class Stepper:
    """Runs this process's train / eval / predict steps (see the module doc).

    Args:
        engine: runs the actions of the schedule over this process's stages.
        ctx: the process's context.
        reads_targets: a ``loss_fn`` reads targets (else the model computes its loss).
        counter: counts a micro-batch's ``labels`` for a model's own token loss.
        reductions: the gradients' sums over ranks, in the order they run (training).
        gathers: what every mode runs around its actions (FSDP's gathers).
        grads: the gradients of this process's parameters.
        fsdp_replicas: the replicas FSDP's reduction averages over (1 without FSDP).
    """

    def __init__(
        self,
        engine: Engine,
        ctx: Context,
        *,
        reads_targets: bool,
        counter: Counter | None,
        reductions: Sequence[StepSync],
        gathers: Sequence[StepSync],
        grads: StepGradients,
        fsdp_replicas: int,
    ) -> None:
        self.engine = engine
        self.ctx = ctx
        self.reads_targets = reads_targets
        self.counter = counter
        self.reductions = tuple(reductions)
        self.gathers = tuple(gathers)
        self.grads = grads
        self.fsdp_replicas = fsdp_replicas
        # Ends whose passes run on every rank read the batch there.
        every = engine.ends.every_rank
        self._first = 0 in engine.stages or every
        self._last = engine.schedule.stages - 1 in engine.stages or every
        # Whether the last step's loss was a pair (None before the first): a later step
        # may not rescale gradients that earlier scalar steps left in .grad.
        self.pair: bool | None = None

    def needs(self, mode: Mode) -> Needs:
        """What this process reads of a batch (:func:`~conveyor.runtime.microbatch.needs`)."""
        return microbatch.needs(self._first, self._last, mode, self.reads_targets)

    def run(
        self,
        mode: Mode,
        inputs: Any = None,
        targets: Any = None,
        cut: Any = None,
        count: float | None = None,
    ) -> StepOutput:
        """One step over ``inputs`` / ``targets`` (or the micro-batches ``cut`` by the
        user): the loss of the whole (global) batch on every rank, and with
        ``mode="train"`` its gradient added to each local ``.grad``. ``count``: divide by
        this instead of the summed count. Collective in a distributed world.
        """
        batch = self._divide(mode, inputs, targets, cut)
        engine = self.engine
        header = engine.header(batch)
        aux_weight = None
        routed = engine.ends.routed and mode != "predict"
        if header.counts is not None and routed:
            aux_weight = router_weight(header.counts, self.ctx, count)
        if mode != "train":  # no backward: nothing to scale
            record = engine.run(mode, batch, header, 1.0, self.gathers, aux_weight)
            return StepOutput(record, None if mode == "predict" else self._combine(record, count))
        # Every replica divides by the global batch's rows: the replicas then sum.
        rows = global_rows(sum(header.sizes), self.ctx)
        scale = loss_scale(rows, self.fsdp_replicas)
        # Earlier gradients are put aside (a copy's memory) only where the step must act
        # on its own: reductions over ranks, or a division by a count after the backward
        # (a pair loss's, or ``count``).
        grads = self.grads
        had = grads.any()
        rescaled = count is not None or self.pair is not False
        isolate = bool(self.reductions) or (had and rescaled)
        if isolate:
            grads.put_aside()
        try:
            syncs = (*self.reductions, *self.gathers)
            record = engine.run(mode, batch, header, scale, syncs, aux_weight)
            combined = self._combine(record, count)
            if had and not isolate and combined.gradient_factor != 1.0:
                raise PipelineError(
                    "loss_fn returned pairs (total, count) in this step but scalars in "
                    "earlier ones whose gradients are still in .grad; zero the gradients "
                    "before switching, or return the same kind in every step"
                )
            self.pair = combined.pair
            grads.scale(combined.gradient_factor)
        except BaseException:
            if isolate:
                grads.give_back()
            raise
        if isolate:
            grads.add_back()
        return StepOutput(record, combined)

    def _divide(self, mode: Mode, inputs: Any, targets: Any, cut: Any) -> MicroBatches:
        """The step's micro-batches: ``inputs`` / ``targets`` divided, or those ``cut``."""
        m, needs, device = self.engine.schedule.microbatches, self.needs(mode), self.ctx.device
        counter = self.counter if mode != "predict" else None
        if cut is not None:
            return microbatch.prepare_cut(cut, m, needs, device, counter)
        return microbatch.prepare(inputs, targets, m, needs, device, counter)

    def _combine(self, record: StepRecord, count: float | None) -> Combined:
        sums = record.sums
        assert sums is not None
        if self.ctx.distributed and self.ctx.replicas > 1:
            sum_over_replicas(sums, self.ctx)
        return combine(sums, count)
