"""Capture a model once, in the test process, for the workers it forks.

``Pipeline(model, ..., sample=...)`` on a model that ``torch.fx`` cannot trace (the
transformers models) captures it with ``torch.export`` on the first micro-batch: seconds
of CPU, on every rank, for every model. conveyor keeps each capture with its model object
(``conveyor/partition/capture.py``'s cache, keyed by the model's modules, parameters and
mode and the sample's structure). A model captured here before the workers are forked
(``tests.support.distributed.run(..., fork=True)``) reaches every worker with its capture,
so each rank splits the very graph its own export would have made (export is
deterministic: the same model and sample give the same program) instead of exporting it
again: the 4 ranks of a world share one export instead of making 4 on 2 cores.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from conveyor.partition.capture import capture
from conveyor.runtime import microbatch


def captured(model: nn.Module, inputs: Any, microbatches: int) -> nn.Module:
    """``model``, captured here as ``Pipeline(model, microbatches=microbatches,
    sample=(inputs, None))`` captures it: on the first micro-batch of ``inputs`` (every
    rank captures on stage 0's first micro-batch; only its structure, not its values, keys
    the cache)."""
    capture(model, microbatch.first(inputs, microbatches))
    return model
