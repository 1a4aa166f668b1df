"""Which keys a query may attend: causal order by the tokens' global index, a sliding
window, the document each token belongs to (packed rows), and padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rule:
    """The attention's mask. ``causal``: a query attends keys at its index or before;
    ``window``: and fewer than ``window`` tokens behind it (None: no window)."""

    causal: bool
    window: int | None = None


@dataclass(frozen=True)
class Tokens:
    """Some tokens of each cp rank this process computes (``V`` of them).

    Attributes:
        index: ``[V, L]`` their global indices in the sequence, on the CPU (what is masked
            by index alone is decided there: no device sync).
        doc: ``[V, B, L]`` the document each belongs to (rows packed from several
            documents), or None (one document per row).
        valid: ``[V, B, L]`` True where the token may be attended (not padding), or None.
    """

    index: Tensor
    doc: Tensor | None = None
    valid: Tensor | None = None

    def narrow(self, start: int, length: int) -> Tokens:
        """The tokens ``start .. start + length`` of each rank's."""
        return Tokens(
            self.index.narrow(-1, start, length),
            None if self.doc is None else self.doc.narrow(-1, start, length),
            None if self.valid is None else self.valid.narrow(-1, start, length),
        )


NOTHING = torch.zeros((), dtype=torch.bool)
""":func:`by_index`'s answer when no query may attend any key (the block is skipped)."""


def by_index(rule: Rule, queries: Tensor, keys: Tensor) -> Tensor | None:
    """What the tokens' indices alone allow (causal order, window), on the CPU, shaped
    ``[V, 1, 1, Lq, Lk]``: None when every query may attend every key, :data:`NOTHING` when
    none may attend any. ``queries``, ``keys``: ``[V, L]`` global indices."""
    qi = queries[:, None, None, :, None]
    ki = keys[:, None, None, None, :]
    mask: Tensor | None = None
    if rule.causal:
        mask = ki <= qi
    if rule.window is not None:
        near = qi - ki < rule.window
        mask = near if mask is None else mask & near
    if mask is None:
        return None
    if not bool(mask.any()):
        return NOTHING
    return None if bool(mask.all()) else mask


def by_data(queries: Tokens, keys: Tokens) -> Tensor | None:
    """What the documents and the padding allow, on their device, shaped ``[V, B, 1, Lq,
    Lk]`` (or ``[V, B, 1, 1, Lk]``); None when they allow everything."""
    mask: Tensor | None = None
    if queries.doc is not None and keys.doc is not None:
        mask = queries.doc[:, :, None, :, None] == keys.doc[:, :, None, None, :]
    if keys.valid is not None:
        valid = keys.valid[:, :, None, None, :]
        mask = valid if mask is None else mask & valid
    return mask


def both(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Allowed by ``a`` and by ``b`` (None allows everything)."""
    if a is None:
        return b
    return a if b is None else a & b
