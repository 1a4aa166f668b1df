"""A micro-batch as one cp rank's stages see it: every value with the sequence dimension
cut to the rank's two chunks (:mod:`~conveyor.context_parallel.layout`), positions global,
next-token labels shifted before the cut, and the documents and padding of the whole
sequence passed on for the attention.

Which values carry the sequence: in a dict, every tensor of two or more dimensions whose
dimension 1 is the sequence's length (``input_ids``', else ``inputs_embeds``', else the
first such tensor's); in a tuple or a single tensor, likewise, the length taken from the
first tensor. The world of one process holds every cp rank's share, stacked on the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from conveyor.context_parallel import install, layout
from conveyor.errors import ConfigError

IGNORE = -100
"""transformers' label of a token that is not predicted."""


def _length(value: Any) -> int | None:
    """The sequence length of a micro-batch (module doc), or None if it has none."""
    if isinstance(value, dict):
        for name in ("input_ids", "inputs_embeds"):
            t = value.get(name)
            if isinstance(t, Tensor) and t.dim() >= 2:
                return t.size(1)
    for t in pytree.tree_leaves(value):
        if isinstance(t, Tensor) and t.dim() >= 2:
            return t.size(1)
    return None


def documents(positions: Tensor) -> Tensor:
    """Each token's document from ``[B, S]`` position ids that restart at each document
    (transformers' ``DataCollatorWithFlattening``): a new one wherever a position does
    not follow the one before it."""
    first = positions[:, :1] - 1
    return (torch.diff(positions, dim=1, prepend=first) != 1).cumsum(dim=1)


@dataclass(frozen=True)
class Cut:
    """How this process cuts its micro-batches.

    Attributes:
        cp: The cp ranks.
        ranks: The cp ranks whose share this process holds (one across processes, all
            of them in one process), stacked on the rows in this order.
        key: The layout's key for the attention operator.
        transformers: The model takes conveyor's keywords through transformers'
            attention interface (positions, documents and padding are passed on).
        shift_labels: Next-token labels: ``labels`` are shifted before the cut and given
            as ``shift_labels`` (transformers' causal LM losses read them as they are).
        shift_targets: A ``loss_fn``'s targets are next-token targets, shifted before the
            cut with this ``ignore_index`` at the end (a ``TokenCrossEntropy(shift=True)``,
            which then runs unshifted); None: cut as they are.
    """

    cp: int
    ranks: tuple[int, ...]
    key: int
    transformers: bool
    shift_labels: bool
    shift_targets: int | None = None

    def share(self, t: Tensor) -> Tensor:
        """``t``'s share along dimension 1 (every held rank's, stacked on dimension 0)."""
        parts = [layout.cut(t, 1, self.cp, r) for r in self.ranks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _cut(self, value: Any, length: int) -> Any:
        """Every tensor of ``value`` with the sequence dimension, cut; others as they are
        (stacked ranks repeat them on the rows)."""
        stacked = len(self.ranks)

        def one(t: Any) -> Any:
            if not isinstance(t, Tensor) or t.dim() == 0:
                return t
            if t.dim() >= 2 and t.size(1) == length:
                return self.share(t)
            return t if stacked == 1 else torch.cat([t] * stacked)

        return pytree.tree_map(one, value)

    def inputs(self, value: Any) -> Any:
        """The first stage's micro-batch for this process (module doc).

        Raises:
            ConfigError: no value has a sequence dimension, or its length is not a
                multiple of ``2 * cp``.
        """
        length = _length(value)
        if length is None:
            raise ConfigError(
                "with cp > 1 the inputs need a sequence dimension (dimension 1 of a tensor "
                "of two or more dimensions) to cut; pass [batch, sequence, ...] tensors"
            )
        layout.chunk_length(length, self.cp)
        if not (self.transformers and isinstance(value, dict)):
            return self._cut(value, length)
        value = dict(value)
        rows = value.get("input_ids", value.get("inputs_embeds"))
        assert isinstance(rows, Tensor)
        positions = value.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=rows.device).expand(rows.size(0), length)
        else:  # the user's positions may restart: packed documents (no host sync to ask)
            value[install.DOC] = documents(positions)
        value["position_ids"] = positions
        labels = value.get("labels")
        if self.shift_labels and isinstance(labels, Tensor) and "shift_labels" not in value:
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
            value["shift_labels"] = value["labels"] = shifted
        # The whole sequence's documents and padding ([B, S], not cut): the attention
        # masks any rank's keys by them.
        whole = {k: value.pop(k) for k in (install.DOC,) if k in value}
        mask = value.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2:
            whole[install.VALID] = mask.bool()
        out = self._cut(value, length)
        out[install.KEY] = self.key
        # Stacked ranks repeat them on the rows, so every input has the model's batch
        # size (a capture makes the rows one size); the attention reads the first copy.
        out.update({k: torch.cat([v] * len(self.ranks)) for k, v in whole.items()})
        return out

    def targets(self, value: Any, length: int) -> Any:
        """A ``loss_fn``'s targets for this process: shifted if they are next-token
        targets, then cut like the inputs."""
        ignore = self.shift_targets
        if ignore is not None:
            value = pytree.tree_map(
                lambda t: (
                    F.pad(t[:, 1:], (0, 1), value=ignore)
                    if isinstance(t, Tensor) and t.dim() > 1 and t.size(1) == length
                    else t
                ),
                value,
            )
        return self._cut(value, length)

    def count(self, labels: Tensor) -> Tensor:
        """The next-token labels this process scores (a causal LM's own loss)."""
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        return self.share(shifted).ne(IGNORE).sum()
