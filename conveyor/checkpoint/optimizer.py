"""Optimizer state and hyperparameters keyed by parameter name, not by position."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from conveyor.checkpoint.dcp import unpack
from conveyor.checkpoint.view import View


def hyper_json(param_group: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer param group's hyperparameters as JSON values (tuples as lists)."""

    def as_json(v: Any) -> Any:
        """``v`` as a JSON value; TypeError for what JSON cannot hold."""
        if isinstance(v, Tensor):
            return v.tolist()
        if isinstance(v, (tuple, list)):
            return [as_json(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(type(v).__name__)

    out: dict[str, Any] = {}
    for k, v in param_group.items():
        if k != "params":
            with contextlib.suppress(TypeError):  # kept as the optimizer has it on load
                out[k] = as_json(v)
    return out


def _hyper_restore(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters in the types of the current group's (tuple, tensor, ...)."""
    out = {k: v for k, v in current.items() if k != "params"}
    for k, v in saved.items():
        cur = current.get(k)
        if isinstance(cur, Tensor):
            out[k] = torch.tensor(v, dtype=cur.dtype, device=cur.device)
        elif isinstance(cur, tuple):
            out[k] = tuple(v)
        else:
            out[k] = v
    return out


def optimizer_index(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    """``id(param) -> (index in optimizer.state_dict()['state'], param group)``."""
    out: dict[int, tuple[int, int]] = {}
    i = 0
    for g, param_group in enumerate(optimizer.param_groups):
        for p in param_group["params"]:
            out.setdefault(id(p), (i, g))
            i += 1
    return out


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    opt_index: dict[int, tuple[int, int]],
    view: View,
    chosen: list[str | None],
    state: dict[str, Any],
    opt_meta: dict[str, Any],
) -> None:
    """Build ``optimizer``'s state dict from the loaded entries, by parameter name."""
    per_param: dict[int, dict[str, Any]] = {}
    group_of: dict[int, int] = {}
    for e, c in zip(view.entries, chosen, strict=True):
        if c is None or not e.param or id(e.value) not in opt_index:
            continue
        i, g = opt_index[id(e.value)]
        prefix = f"optim/{c}/"
        param_state = {
            k[len(prefix) :]: unpack(v) for k, v in state.items() if k.startswith(prefix)
        }
        if param_state:
            per_param[i] = param_state
        if c in opt_meta["group_of"] and g not in group_of:
            group_of[g] = opt_meta["group_of"][c]
    current = optimizer.state_dict()
    param_groups = []
    for g, param_group in enumerate(current["param_groups"]):
        saved = opt_meta["param_groups"][group_of[g]] if g in group_of else {}
        param_groups.append({**_hyper_restore(saved, param_group), "params": param_group["params"]})
    optimizer.load_state_dict({"state": per_param, "param_groups": param_groups})
