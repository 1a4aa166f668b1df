"""Planning a model built on the meta device (:func:`conveyor.empty_weights`) without ever
holding it whole.

The profiler times one unit at a time on a real copy of that unit alone (:class:`RealUnits`):
its meta tensors get values on the device exactly as a pipeline stage gets them (the
checkpoint's, or the module's own initialization seeded by its name), the unit is timed,
and the copy's tensors are released before the next unit is made. The model itself stays
on the meta device. Calibration builds its reference pipelines on a meta copy of the model
(:func:`meta_copy`), so each rank makes real only its own stages of the reference.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from conveyor.weights import Weights, has_meta
from conveyor.weights.fill import check, fill
from conveyor.weights.plan import wanted
from conveyor.weights.sources import open_source

Model = nn.Module | Sequence[nn.Module]


def is_meta(model: Model) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return has_meta(_modules(model))


def as_module(model: Model) -> nn.Module:
    """``model`` as one module whose names are the ones the splitters give its tensors."""
    return model if isinstance(model, nn.Module) else nn.Sequential(*model)


def profiling_device(device: torch.device | str | None) -> torch.device:
    """Where a meta model is profiled: ``device`` (a GPU's index filled in), or by default
    this process's GPU, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.device(device)
    if out.type == "cuda" and out.index is None:
        out = torch.device("cuda", torch.cuda.current_device())
    return out


def meta_copy(model: Model, device: torch.device) -> nn.Module:
    """A copy of ``model`` for a throw-away pipeline on ``device``: its meta tensors are
    new (meta, no memory); its real tensors on ``device`` are the model's own objects, and
    those elsewhere are copied (moving a stage to its device moves its parameters in
    place, which must not move the model's)."""
    module = as_module(model)
    memo: dict[int, Any] = {
        id(t): t for t in _tensors(module) if not t.is_meta and _same(t.device, device)
    }
    return copy.deepcopy(module, memo)


class RealUnits:
    """Real copies of a meta model's units, one at a time.

    Args:
        model: The whole (meta) model; it is never changed.
        device: Where the copies' tensors go.
        init_seed: The seed of the initialization, as ``Pipeline(init_seed=)``.
        weights: A checkpoint to read the units' tensors from, as ``Pipeline(weights=)``,
            or None to initialize them.

    Raises:
        ConfigError: a meta tensor nothing can initialize (the pipeline's own error).
        CheckpointError: ``weights`` lacks a tensor or holds another shape.
    """

    def __init__(
        self, model: Model, device: torch.device, init_seed: int = 0, weights: Weights = None
    ) -> None:
        self.model = as_module(model)
        self.device = device
        self.init_seed = init_seed
        self.source = open_source(weights) if weights is not None else None
        self.found = check(self.model, wanted(self.model, [self.model], False), self.source)

    def real(self, unit: nn.Module) -> nn.Module:
        """A copy of ``unit`` (named as in the model) with every tensor real on the device:
        real ones already there are shared, others copied there, meta ones given values.

        Returns:
            The copy; hand it to :func:`release` when done.
        """
        here = self.device
        memo: dict[int, Any] = {
            id(t): t for t in _tensors(unit) if not t.is_meta and _same(t.device, here)
        }
        with warnings.catch_warnings():
            # torch's own deprecation, met copying the tree specs of a torch.export capture
            warnings.filterwarnings("ignore", "`isinstance\\(treespec, LeafSpec\\)`", FutureWarning)
            made = copy.deepcopy(unit, memo)
        made._apply(lambda t: t if t.is_meta or _same(t.device, here) else t.to(here))  # type: ignore[no-untyped-call]
        plan = wanted(self.model, [made], everything=False)
        if plan:
            fill(self.model, plan, here, self.init_seed, self.source, self.found)
        return made


def release(unit: nn.Module) -> None:
    """Drop a copy's references to its tensors, so their memory is freed now even if
    something still holds the module (a graph module refers to itself, so only the cycle
    collector would free it)."""
    for module in unit.modules():
        module._parameters.clear()
        module._buffers.clear()


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index == b.index or a.type == "cpu")


def _tensors(module: nn.Module) -> list[Tensor]:
    out: list[Tensor] = []
    for m in module.modules():
        out += [t for t in m._parameters.values() if t is not None]
        out += [t for t in m._buffers.values() if t is not None]
    return out


def _modules(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


__all__ = ["RealUnits", "as_module", "is_meta", "meta_copy", "profiling_device", "release"]
