"""A transformers checkpoint in the layout transformers saves, seen under the model's names.

transformers (>= 5) keeps some tensors in another form in the model than in its files: a
mixture-of-experts layer's experts are one 3-D tensor per projection
(``mlp.experts.gate_up_proj: [num_experts, 2 * intermediate, hidden]``), while
``save_pretrained`` writes them, as the published checkpoints hold them, one 2-D tensor per
expert under older names (``block_sparse_moe.experts.3.w1.weight``). ``from_pretrained``
converts on load with the model's conversion mapping (renamings and converters such as
"stack the experts, then concatenate gate and up"). :class:`Converted` applies the same
mapping, transformers' own objects, to a :class:`~conveyor.weights.sources.Safetensors`
source: it lists the model's names, gives their shapes without reading (the conversion run
on meta tensors), and reads a converted tensor from the stored ones it is made of.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from conveyor.weights.safetensors_file import Part
from conveyor.weights.sources import Safetensors, Source


class Converted:
    """``source`` under the model's names, converted by ``mapping`` (transformers' weight
    transforms of the model, as ``from_pretrained`` applies them)."""

    def __init__(self, source: Source, model: nn.Module, mapping: list[Any]) -> None:
        from transformers.core_model_loading import (
            WeightConverter,
            dot_natural_key,
            rename_source_key,
        )

        self.where = source.where
        self._source, self._model = source, model
        renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        own = set(model.state_dict(keep_vars=True))
        self._plain: dict[str, str] = {}  # model name -> stored name
        # first target name -> (converter, source pattern -> stored names, in expert order)
        groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        for key in sorted(source.names(), key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters)
            if key in own or (pattern is None and renamed == key):
                self._plain.setdefault(key, key)
            elif pattern is None:
                self._plain.setdefault(renamed, key)
            else:
                _, parts = groups.setdefault(renamed, (by_pattern[pattern], {}))
                parts.setdefault(pattern, []).append(key)
        # Each group's outputs and their shapes: the conversion on meta tensors.
        self._group_of: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._groups = groups
        for first in groups:
            for name, value in self._convert(first, meta=True).items():
                if name not in self._plain:
                    self._group_of[name] = first
                    self._shapes[name] = tuple(value.shape)

    def _convert(self, first: str, meta: bool) -> dict[str, Tensor]:
        """The tensors group ``first`` converts to, by the model's names (on the meta
        device: shapes only, nothing read)."""
        template, parts = self._groups[first]
        converter = copy.deepcopy(template)  # it collects its inputs: one per conversion
        stored = [k for keys in parts.values() for k in keys]
        values = (
            {k: torch.empty(self._source.shape(k), device="meta") for k in stored}
            if meta else self._source.read(stored)
        )  # fmt: skip
        for pattern, keys in parts.items():
            for k in keys:
                converter.add_tensor(first, k, pattern, lambda v=values[k]: v)
        config = getattr(self._model, "config", None)
        out: dict[str, Tensor] = converter.convert(first, model=self._model, config=config)
        return out

    def names(self) -> list[str]:
        return [*self._plain, *self._group_of]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._plain:
            return self._source.shape(self._plain[name])
        return self._shapes[name]

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        wanted = list(names)
        plain = [n for n in wanted if n in self._plain]
        values = self._source.read(self._plain[n] for n in plain)
        out.update({n: values[self._plain[n]] for n in plain})
        for first in dict.fromkeys(self._group_of[n] for n in wanted if n not in self._plain):
            converted = self._convert(first, meta=False)
            out.update({n: v.contiguous() for n, v in converted.items() if n in wanted})
        return out

    def read_part(self, name: str, part: Part) -> Tensor:
        if name in self._plain:
            return self._source.read_part(self._plain[name], part)
        # A converted tensor is made from whole stored ones (experts stacked, projections
        # concatenated): read whole, then cut.
        return self.read([name])[name][part].clone()

    def alias(self, name: str) -> str:
        return name


def conversion_mapping(model: nn.Module) -> list[Any]:
    """The weight conversions ``from_pretrained`` applies to ``model``: a transformers
    model's conversion mapping, [] for another model (or a transformers without them)."""
    if "transformers" not in sys.modules:
        return []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without conversion mappings (< 5): names as stored
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    mapping: list[Any] = get_model_conversion_mapping(model)
    return mapping


def converted(source: Source, model: nn.Module) -> Source:
    """``source`` as the model sees it: a transformers checkpoint of a transformers model
    whose conversion mapping changes names or tensors (MoE experts) is :class:`Converted`;
    anything else is ``source`` itself."""
    mapping = conversion_mapping(model) if isinstance(source, Safetensors) else []
    return Converted(source, model, mapping) if mapping else source
