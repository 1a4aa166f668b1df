"""The small MLP and its batches, which most tests train.

How tests compare, train and clean up is in ``helpers.py``; models of other shapes in
``zoo.py`` and ``real_models.py``.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp(layers: int = 6, width: int = 16, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear, Tanh) then a Linear head to 4 outputs: 2*layers+1 modules."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(8 if i == 0 else width, width), nn.Tanh()]
    mods.append(nn.Linear(width, 4))
    return nn.Sequential(*mods)


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def readme_model() -> nn.Sequential:
    """The README's model: 8x8 inputs flattened, two hidden layers of 512, 10 classes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )
