"""Losses that stay exact however a batch is cut: they return a pair ``(total, count)``.

A loss averaged over tokens (padded, variable-length rows, ``ignore_index``) is not a mean
over rows, so a mean per micro-batch weighted by its rows is not the whole batch's loss.
Returned as ``(summed loss, items summed)``, :class:`conveyor.Pipeline` divides the sum
over every micro-batch and replica by the summed count: the unsplit model's loss.

:class:`TokenCrossEntropy` is the common case. :func:`model_token_loss` recognises a
transformers language model whose own loss averages over tokens: with ``loss_fn=None``
the pipeline counts its labels' tokens per micro-batch and weighs the model's loss by
them, which is what passing the whole batch's count as ``num_items_in_batch`` gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["ModelTokenLoss", "TokenCrossEntropy", "model_token_loss", "output_field"]

# transformers' losses that average over counted tokens (num_items_in_batch); causal LMs
# predict label i + 1 at position i, so their first label is never counted.
_TOKEN_LOSSES = {"ForCausalLMLoss": True, "ForMaskedLMLoss": False}


def output_field(output: Any, name: str) -> torch.Tensor | None:
    """A model output's tensor ``name`` (a ``ModelOutput`` / dict entry or attribute), or
    None where it has none."""
    found = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
    return found if isinstance(found, torch.Tensor) else None


def _logits(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or its ``logits``."""
    if isinstance(output, torch.Tensor):
        return output
    found = output_field(output, "logits")
    if found is None:
        raise TypeError(
            f"TokenCrossEntropy needs logits: a tensor or an output with .logits, got "
            f"{type(output).__name__}"
        )
    return found


class TokenCrossEntropy:
    """Cross-entropy averaged over the tokens whose target is not ``ignore_index``, as the
    pair ``(summed loss, counted tokens)``: pass it as ``Pipeline(loss_fn=...)``.

    With ``shift=True`` the logits at position ``i`` predict target ``i + 1`` (a causal LM
    given its input ids as targets). ``label_smoothing`` is ``F.cross_entropy``'s.

    Args:
        ignore_index: The target value that is not a token to predict (padding).
        label_smoothing: In [0, 1).
        shift: Predict the next token.

    Example:
        ``TokenCrossEntropy()(logits, targets)`` is ``(total, count)`` with
        ``total / count == F.cross_entropy(logits.flatten(0, -2), targets.flatten(),
        ignore_index=-100)``.
    """

    def __init__(
        self, ignore_index: int = -100, label_smoothing: float = 0.0, shift: bool = False
    ) -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.shift = shift

    def __call__(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed token loss and its count of counted tokens."""
        logits = _logits(output)
        if self.shift:
            logits, target = logits[..., :-1, :], target[..., 1:]
        target = target.reshape(-1)
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            target,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction="sum",
        )
        return total, target.ne(self.ignore_index).sum()

    def __repr__(self) -> str:
        return (
            f"TokenCrossEntropy(ignore_index={self.ignore_index}, "
            f"label_smoothing={self.label_smoothing}, shift={self.shift})"
        )


class ModelTokenLoss:
    """A transformers model's own token loss (``model.loss_function``) over a micro-batch,
    as the pair ``(summed loss, counted tokens)``: counted as ``transformers.Trainer``
    counts ``num_items_in_batch`` (``labels[..., 1:]`` for causal LMs).

    Args:
        model: The model (its ``loss_function`` and ``config.vocab_size`` are used).
        shifts: Whether the loss predicts label ``i + 1`` at position ``i``.
    """

    def __init__(self, model: Any, shifts: bool) -> None:
        self.model = model
        self.shifts = shifts

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The tokens of ``labels`` the loss averages over."""
        counted = labels[..., 1:] if self.shifts else labels
        return counted.ne(-100).sum()

    def __call__(self, output: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed token loss and its count."""
        total: torch.Tensor = self.model.loss_function(
            _logits(output),
            labels,
            vocab_size=self.model.config.vocab_size,
            num_items_in_batch=1,  # the loss divides by it: the plain sum
        )
        return total, self.count(labels)


def model_token_loss(model: Any) -> ModelTokenLoss | None:
    """The pair loss for a transformers model whose own loss averages over tokens (causal
    and masked LMs: ``loss_function`` takes ``num_items_in_batch``),
    or None for any other model. Encoder-decoder models are left to compute their own loss:
    they build decoder inputs from the labels."""
    loss_function = getattr(type(model), "loss_function", None)
    config = getattr(model, "config", None)
    if loss_function is None or config is None or getattr(config, "is_encoder_decoder", False):
        return None
    try:
        name = getattr(model.loss_function, "__name__", "")
    except Exception:  # a loss_type transformers does not know
        return None
    if name not in _TOKEN_LOSSES or getattr(config, "vocab_size", None) is None:
        return None
    return ModelTokenLoss(model, _TOKEN_LOSSES[name])
