"""How a model's tensors are stored in the checkpoints published for it: the names and
layout transformers' own ``save_pretrained`` writes, which ``save_pretrained`` and
``conveyor convert`` both write.

For most models and tensors that is the tensor under its own name. A transformers model
keeps some tensors in another form than its files do (a mixture-of-experts layer's experts
are one 3-D tensor per projection; its published checkpoints hold one 2-D tensor per
expert under older names), and ``save_pretrained`` writes them through transformers'
reverse weight conversion: :class:`Published` applies the same, group by group. A weight
tied under several names is stored once, under the name transformers keeps.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import Tensor, nn

from conveyor.weights.safetensors_file import TensorInfo

CONFIGS = ("config.json", "generation_config.json")
"""The configs a published checkpoint holds beside its weights (the second when the
model generates)."""


class Published:
    """The published form of ``model``'s tensors (``None``: every tensor as it is).

    Args:
        model: The model (its parameters may be on the meta device), or None.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self._revert: Any = None
        self._converters: list[Any] = []
        self._apply: Any = None
        self._tied: list[str] = []
        self._order: dict[str, int] = {}
        self._ignored: set[str] = set()
        if model is None:
            return
        self._order = {n: i for i, n in enumerate(model.state_dict(keep_vars=True))}
        self._ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                PrefixChange,
                WeightConverter,
                apply_converters,
                revert_weight_conversion,
            )
        except ImportError:  # no transformers, or one without conversions (< 5)
            return
        if not isinstance(model, PreTrainedModel):
            return
        self._revert, self._apply = revert_weight_conversion, apply_converters
        # The conversions revert_weight_conversion reverts, as it picks them for a model
        # that from_pretrained did not load.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            conversions = [
                c
                for c in get_model_conversion_mapping(model, add_legacy=False)
                if not isinstance(c, PrefixChange)
            ]
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        self._converters = [c for c in reverse if isinstance(c, WeightConverter)]
        with contextlib.suppress(Exception):  # a model without tie declarations
            from transformers.modeling_utils import _get_tied_weight_keys

            self._tied = list(_get_tied_weight_keys(model))

    def preferred(self, canon: dict[str, str]) -> dict[str, str]:
        """``canon`` (each name -> its tie group's stored name) with each group stored under
        the name the model's own checkpoints use: the first in the model's order that is
        not a declared tied copy (``lm_head.weight`` of a model tying it to the
        embedding)."""
        groups: dict[str, list[str]] = {}
        for name, c in canon.items():
            groups.setdefault(c, []).append(name)
        out = {}
        for names in groups.values():
            ordered = sorted(names, key=lambda n: (self._order.get(n, len(self._order)), n))
            kept = [n for n in ordered if not any(re.search(p, n) for p in self._tied)]
            out.update(dict.fromkeys(names, (kept or ordered)[0]))
        return out

    def tied_copies(self) -> dict[str, str]:
        """Each other name of a weight the model ties -> the name it is stored under."""
        if self.model is None:
            return {}
        names: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        canon = {n: group[0] for group in names.values() for n in group}
        return {n: c for n, c in self.preferred(canon).items() if n != c}

    def groups(self, names: list[str]) -> list[list[str]]:
        """``names`` grouped as transformers converts them together (one group for
        tensors that make one stored tensor), in the order of their first names."""
        found: dict[tuple[bool, str], list[str]] = {}
        for n in names:
            renamed, pattern = self._apply(n, self._converters) if self._apply else (n, None)
            key = (True, renamed) if pattern is not None else (False, n)
            found.setdefault(key, []).append(n)
        return list(found.values())

    def revert(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """One group's tensors (:meth:`groups`) under the names and in the layout the
        model's checkpoints store them; ignored names (``_keys_to_ignore_on_save``) left
        out."""
        values = {n: v for n, v in values.items() if n not in self._ignored}
        if self._revert is None or not values:
            return values
        with torch.no_grad():
            out: dict[str, Tensor] = self._revert(self.model, values)
        return out

    def infos(self, names: dict[str, Tensor]) -> list[TensorInfo]:
        """The header entries of what a group of tensors (any device, meta included,
        shaped as the whole tensors) is stored as."""
        meta = {n: torch.empty(v.shape, dtype=v.dtype, device="meta") for n, v in names.items()}
        return [TensorInfo.of(n, v) for n, v in self.revert(meta).items()]
