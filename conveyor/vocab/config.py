"""What the vocabulary passes are configured with: the loss the shards compute and the
group they run on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabLoss:
    """The token cross-entropy computed from the shards: ``ignore_index``,
    ``label_smoothing``, ``shift`` (position i predicts target i + 1), whether the targets
    are the ``labels`` of the inputs (a transformers model's own loss), and what counts a
    micro-batch's items (None: its counted tokens)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    shift: bool = False
    labels_in_inputs: bool = False
    counter: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class Group:
    """The vocabulary group: the process group, and the global ranks of the first and
    last stages' pipeline ranks (None in a world of one process)."""

    group: Callable[[], dist.ProcessGroup] | None
    first: int
    last: int
    me: int
    timeout: float
