"""FSDP over the data-parallel replicas for the vocabulary rows (``fsdp=True`` with
``vocab_parallel``): each pipeline rank's rows sharded further over ``dp``.

The holder of the two layers is one FSDP2 unit (:class:`~conveyor.runtime.sharding.Sharded`)
over ``mesh["dp"]``: torch's FSDP shards dim 0 of each weight's local rows (a DTensor
``Shard(0)`` over the pipeline ranks, as it shards tensor-parallel weights), so a rank
stores its dp-share of its pp rows, parameter, gradient and optimizer state, as one
DTensor over the ``(dp, pp)`` mesh under the original name. A step gathers the rows when
it starts (every mode; the first vocabulary pass waits for them) and, training, reduce-
scatters their gradients and reshards at its end (:meth:`StepSync.finish`, which every
replica reaches at the same point of the same program). The passes never call the
layers, so FSDP's own hooks never run: the gradients the passes add to the gathered
weights are what the reduce-scatter reads, averaged over the replicas like the stages'
(the loss scale's ``fsdp_replicas`` undoes it).
"""

from __future__ import annotations

from typing import Any

from conveyor.context import Context
from conveyor.runtime.program import RankProgram
from conveyor.runtime.sharding import Sharded
from conveyor.runtime.step_sync import StepSync
from conveyor.vocab.runner import VocabRunner
from conveyor.vocab.shards import VocabShards

_UNIT = -1  # the holder's key among Sharded's units (stages have indices >= 0)


class VocabSharded(StepSync):
    """The vocabulary rows under FSDP over ``dp``, gathered and reduced once per step
    (module doc). Install in the step's gathers (it runs in every mode)."""

    def __init__(self, shards: VocabShards, runner: VocabRunner, ctx: Context) -> None:
        assert ctx.mesh is not None
        self.sharded = Sharded({_UNIT: shards.holder}, ctx.mesh["dp"])
        runner.ready = self.ready
        self.shards = shards
        self._train = False
        self._sharded: set[int] = set()  # ids of the sharded parameters (not gathered)

    def begin(self, program: RankProgram) -> None:
        """Start gathering the rows over the replicas."""
        from torch.distributed.fsdp import fully_shard

        # The holder never runs forward, where FSDP would make it a root (after meta
        # weights got their values: not at construction).
        state: Any = fully_shard.state(self.shards.holder)  # type: ignore[attr-defined]
        state._lazy_init()  # once; later calls return at once
        self._train = program.train
        self._sharded = {id(p) for p in self.shards.holder.parameters()}
        self.sharded.begin([_UNIT])

    def ready(self) -> None:
        """Wait for the gather (before each vocabulary pass; only the first waits)."""
        self.sharded.ready(_UNIT)

    def finish(self) -> None:
        """Reduce-scatter the step's gradients (training) and reshard."""
        self.sharded.release(_UNIT, self._train)

    def abort(self) -> None:
        """A failed step: its partial gradients on the gathered rows are dropped (no
        collective here: the replicas may have stopped at different points); the sharded
        ones, the earlier steps', are kept."""
        for module in (self.shards.embedding, self.shards.output):
            if id(module.weight) not in self._sharded:
                module.weight.grad = None
