"""The few FSDP2 internals conveyor needs, in one place, for every torch it admits.

FSDP2 reduces a unit's gradients from autograd hooks that fire when a backward passes
through the unit. A schedule that computes weight gradients in a later W, outside that
backward, must start the reduction itself once the stage's last W is done, and a unit the
stage ends use without calling it must be initialized without a forward. torch has no
public call for either; ``torch.distributed.pipelining`` (its ``stage.py``) reaches the
same internals for the same reason. Their names moved between torch releases (one param
group per state up to 2.12, ``_fsdp_param_group``; a list from 2.13, ``_fsdp_param_groups``),
so each is read here by what it is, and a torch without any of them is named in one
sentence instead of failing deep inside a step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from conveyor.errors import ConfigError


def _state(module: nn.Module) -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]


def param_groups(state: Any) -> list[Any]:
    """The FSDP param groups of one FSDP state (none, one or several)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise _unsupported("a state's param groups")


def unit_param_groups(module: nn.Module) -> list[Any]:
    """The param groups of the FSDP unit ``module`` (``fully_shard`` applied to it)."""
    return param_groups(_state(module))


def initialize(module: nn.Module) -> None:
    """Initialize the FSDP root ``module`` as its first forward would (once; later
    calls return at once)."""
    state = _state(module)
    if not hasattr(state, "_lazy_init"):
        raise _unsupported("the lazy initialization")
    state._lazy_init()


def reduce_gradients(module: nn.Module) -> None:
    """Reduce-scatter the gradients of the FSDP root ``module`` and of every unit inside
    it, as FSDP's post-backward hooks and its end-of-backward callback would: after a
    backward whose weight gradients were written outside FSDP's hooks."""
    state = _state(module)
    context = getattr(state, "_state_ctx", None)
    final = getattr(state, "_root_post_backward_final_callback", None)
    if context is None or final is None:
        raise _unsupported("the post-backward reduction")
    for each in context.all_states:
        for group in param_groups(each):
            group.post_backward()
    final()


def _unsupported(what: str) -> ConfigError:
    import torch

    return ConfigError(
        f"conveyor cannot reach FSDP2's {what} in torch {torch.__version__} (it uses the "
        f"same internals as torch.distributed.pipelining); use torch 2.10 to 2.13, or run "
        f"without fsdp"
    )
