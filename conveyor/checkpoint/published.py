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
        self._order: dict[str, int] = {}
        self._ignored: set[str] = set()
        self._untie: Any = None
        if model is None:
            return
        self._order = {n: i for i, n in enumerate(model.state_dict(keep_vars=True))}
        self._ignored = ignored_on_save(model)
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                PrefixChange,
                WeightConverter,
                apply_converters,
                revert_weight_conversion,
            )
            from transformers.modeling_utils import remove_tied_weights_from_state_dict
        except ImportError:  # no transformers, or one without conversions (< 5)
            return
        if not isinstance(model, PreTrainedModel):
            return
        self._revert, self._apply = revert_weight_conversion, apply_converters
        self._untie = remove_tied_weights_from_state_dict
        # Which tensors convert together, from the conversions revert_weight_conversion
        # reverts for a model that from_pretrained did not load (conveyor builds its models
        # from configs). A model from_pretrained loaded remembers the conversions its load
        # used in a private attribute, which is not read here: only a conversion unused by
        # that load can differ, and it can only group tensors the revert writes alone (a
        # refusal of save_pretrained, never another file).
        conversions = [
            c
            for c in get_model_conversion_mapping(model, add_legacy=False)
            if not isinstance(c, PrefixChange)
        ]
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        self._converters = [c for c in reverse if isinstance(c, WeightConverter)]

    def preferred(self, canon: dict[str, str]) -> dict[str, str]:
        """``canon`` (each name -> its tie group's stored name) with each group stored under
        the name the model's own checkpoints use: the one transformers' ``save_pretrained``
        keeps (``model.embed_tokens.weight``, not ``lm_head.weight`` of a model tying them),
        else the first in the model's order."""
        groups: dict[str, list[str]] = {}
        for name, c in canon.items():
            groups.setdefault(c, []).append(name)
        out = {}
        for names in groups.values():
            ordered = sorted(names, key=lambda n: (self._order.get(n, len(self._order)), n))
            out.update(dict.fromkeys(names, self._kept(ordered)))
        return out

    def _kept(self, names: list[str]) -> str:
        """The name transformers keeps of the tied ``names`` (in model order): it is asked
        with one shared tensor under every name; the first name where it cannot tell (a
        tie the model does not declare) or the model is not a transformers model."""
        if self._untie is None or len(names) == 1:
            return names[0]
        shared = torch.zeros(1)
        try:
            kept = list(self._untie(dict.fromkeys(names, shared), self.model))
        except RuntimeError:  # a tie the model does not declare
            return names[0]
        return kept[0] if len(kept) == 1 else names[0]

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
        model's checkpoints store them (transformers' own reverse conversion); the names
        the model does not save left out (:func:`ignored_on_save`)."""
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


def ignored_on_save(model: nn.Module) -> set[str]:
    """The names a transformers model leaves out of its checkpoints (Marian's sinusoidal
    position tables, computed again on load).

    transformers has no public accessor for them: its ``save_pretrained`` reads the class
    attribute ``_keys_to_ignore_on_save`` (which ``post_init`` extends with the
    submodels' under their prefixes), so it is read here, and only here.
    """
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())
