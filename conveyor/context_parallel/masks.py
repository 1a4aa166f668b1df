"""Which keys a query may attend: causal order by the tokens' global index, a sliding
window, the document each token belongs to (packed rows), and padding."""

from __future__ import annotations

from dataclasses import dataclass

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
        index: ``[V, L]`` their global indices in the sequence.
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


def allowed(rule: Rule, queries: Tokens, keys: Tokens) -> Tensor | None:
    """True where a query may attend a key, shaped ``[V, B or 1, 1, Lq, Lk]``; None when
    every query may attend every key."""
    qi = queries.index[:, None, None, :, None]
    ki = keys.index[:, None, None, None, :]
    mask: Tensor | None = None

    def both(a: Tensor | None, b: Tensor) -> Tensor:
        return b if a is None else a & b

    if rule.causal:
        mask = both(mask, ki <= qi)
    if rule.window is not None:
        mask = both(mask, qi - ki < rule.window)
    if queries.doc is not None and keys.doc is not None:
        mask = both(mask, queries.doc[:, :, None, :, None] == keys.doc[:, :, None, None, :])
    if keys.valid is not None:
        mask = both(mask, keys.valid[:, :, None, None, :])
    if mask is not None and bool(mask.all()):
        return None
    return mask


def attends_nothing(mask: Tensor | None) -> bool:
    """No query attends any key (the block is skipped)."""
    return mask is not None and not bool(mask.any())
