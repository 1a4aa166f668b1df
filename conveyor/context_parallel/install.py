"""Where a model's attention meets context parallelism, without rewriting the model.

- transformers models: an attention implementation of transformers' own interface
  (``AttentionInterface``), :data:`IMPLEMENTATION`, set on the model. A call that carries
  conveyor's keyword (``conveyor_cp``, which the pipeline adds to the model's inputs and
  transformers passes down to every attention call, with the micro-batch's documents and
  padding) runs :func:`~conveyor.context_parallel.op.context_attention`; any other call
  (the model used outside the pipeline) runs transformers' ``sdpa``, so the setting is
  harmless there. Its mask function is ``sdpa``'s: the pipeline's calls ignore the mask.
- other models (layer lists, fx graphs): :class:`SDPAOverWholeSequence`, a function mode
  the pipeline holds during its steps, runs each
  ``torch.nn.functional.scaled_dot_product_attention`` call over the whole sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from conveyor.context_parallel.op import context_attention
from conveyor.errors import ConfigError

IMPLEMENTATION = "conveyor_context_parallel"
"""The name of conveyor's attention implementation in transformers' interface."""

KEY = "conveyor_cp"
"""The keyword that carries the cp layout's key through a transformers model."""

DOC, VALID = "conveyor_doc", "conveyor_valid"
"""The keywords that carry the micro-batch's documents and padding (``[B, S]``)."""


@functools.cache
def _registered() -> Callable[..., Any]:
    """Register the implementation with transformers once; returns its ``sdpa``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    sdpa: Callable[..., Any] = AttentionInterface()["sdpa"]  # type: ignore[no-untyped-call]

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        layout = kwargs.pop(KEY, None)
        if layout is None:  # outside the pipeline: transformers' sdpa, as the model had
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,  # type: ignore[no-any-return]
                        scaling=scaling, sliding_window=sliding_window, is_causal=is_causal,
                        **kwargs)  # fmt: skip
        for name in ("softcap", "s_aux", "position_bias"):
            if kwargs.get(name) is not None:
                raise ConfigError(
                    f"{type(module).__name__} passes {name} to its attention, which "
                    f"context parallelism does not compute; train this model with cp=1"
                )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = context_attention(
            query, key, value, int(layout), causal=bool(causal), scale=scaling,
            window=sliding_window, dropout_p=dropout, doc=kwargs.get(DOC),
            valid=kwargs.get(VALID),
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return sdpa


def install(model: nn.Module) -> bool:
    """Set conveyor's implementation on a transformers model (True); False for any other
    model (its ``scaled_dot_product_attention`` calls are taken over during steps)."""
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if setter is None or config is None:
        return False
    _registered()
    setter(IMPLEMENTATION)
    return True


class SDPAOverWholeSequence(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` over the whole sequence (module doc);
    ``key``: the cp layout's."""

    def __init__(self, key: int) -> None:
        super().__init__()
        self.key = key

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if attn_mask is not None:
            raise ConfigError(
                "with cp > 1 a scaled_dot_product_attention call got attn_mask, a mask made "
                "from this rank's share of the sequence; use is_causal=True (or no mask), "
                "or a transformers model, whose documents and padding conveyor passes on"
            )
        if query.dim() != 4:
            raise ConfigError(
                f"with cp > 1 scaled_dot_product_attention takes [batch, heads, sequence, "
                f"dim] queries, got {query.dim()} dimensions; reshape to four"
            )
        return context_attention(query, key, value, self.key, causal=is_causal, scale=scale,
                                 dropout_p=dropout_p)  # fmt: skip
