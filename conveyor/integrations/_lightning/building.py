"""The pipeline of a LightningModule's network, built once: the network and its loss
read from the module, the stand-ins put in their place, and, for a network only
``torch.export`` captures, a sample found by a dry run of the module's step first."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.context import Context
from conveyor.errors import ConfigError, one_line
from conveyor.integrations._hf_model import without_cache
from conveyor.integrations._lightning.steps import Interceptor, Kind, LossStyle, SampleFound
from conveyor.integrations._lightning_parts import (
    OutputLoss,
    PipelineLoss,
    PipelineNetwork,
    Scaled,
)
from conveyor.losses import model_token_loss
from conveyor.pipeline import Pipeline
from conveyor.vocab.setup import fx_traces


def network_of(module: nn.Module, module_attr: str) -> nn.Module:
    """The network ``module`` keeps in ``module_attr`` (the original under another
    strategy's stand-in).

    Raises:
        ConfigError: no network there, or parameters of ``module`` outside it.
    """
    network = getattr(module, module_attr, None)
    if isinstance(network, PipelineNetwork):
        network = network.original
    if not isinstance(network, nn.Module):
        raise ConfigError(
            f"PipelineStrategy splits the LightningModule's network, found in "
            f"self.{module_attr}; put the network there (an nn.Module), or name its "
            f"attribute with PipelineStrategy(module_attr=...)"
        )
    inside = {id(p) for p in network.parameters()}
    mine = f"{module_attr}."
    named = module.named_parameters()
    outside = [n for n, p in named if id(p) not in inside and not n.startswith(mine)]
    if outside:
        raise ConfigError(
            f"PipelineStrategy trains self.{module_attr} only, but the LightningModule has "
            f"parameters outside it (e.g. {outside[:3]}); move those layers into "
            f"self.{module_attr}"
        )
    return network


def loss_of(network: nn.Module, user_loss: Callable[..., Any] | None) -> tuple[Scaled, LossStyle]:
    """The pipeline's loss and where it comes from: the module's ``loss_fn``, else the
    network's own token loss (transformers' LMs), else its output's ``loss``."""
    if user_loss is not None:
        return Scaled(user_loss), LossStyle.FN
    token = model_token_loss(network)
    if token is not None:
        return Scaled(token), LossStyle.TOKEN
    return Scaled(OutputLoss()), LossStyle.OWN


def build(
    module: nn.Module,
    steps: Interceptor,
    ctx: Context,
    options: Mapping[str, Any],
    autocast: torch.dtype | None,
    find_sample: Callable[[], tuple[Any, Any]],
) -> Pipeline:
    """Split ``module``'s network into the pipeline and put the stand-ins in its place.

    Args:
        module: The LightningModule.
        steps: The interceptor the stand-ins call (given the loss and the pipeline here).
        ctx: The process's context.
        options: ``Pipeline``'s keywords (``microbatches`` defaults to ``pp``).
        autocast: The precision's autocast dtype.
        find_sample: The network's ``(inputs, targets)`` on a first batch, by a dry run of
            the module's step (called only for a network ``torch.export`` captures on a
            batch, when ``options`` give no ``sample``).

    Returns:
        The pipeline, split.
    """
    network = network_of(module, steps.module_attr)
    user_loss = getattr(module, steps.loss_attr, None)
    if isinstance(user_loss, PipelineLoss):  # another strategy's stand-in
        user_loss = user_loss.loss_fn
    loss, style = loss_of(network, user_loss)
    steps.use_loss(loss, style)
    without_cache(network)
    stand_in = PipelineNetwork(steps, network)
    setattr(module, steps.module_attr, stand_in)
    if user_loss is not None:
        setattr(module, steps.loss_attr, PipelineLoss(steps, user_loss))
    kwargs = dict(options)
    kwargs.setdefault("microbatches", ctx.pp_size)
    if kwargs.get("sample") is None and not fx_traces(network):
        kwargs["sample"] = find_sample()  # the stand-ins record the dry run's inputs
    pipe = Pipeline(network, loss_fn=loss, context=ctx, autocast=autocast, **kwargs)
    steps.use_pipeline(pipe, ctx)
    stand_in.stages = nn.ModuleList(pipe.stages)
    return pipe


def dry_run(
    steps: Interceptor, module: nn.Module, step: str, kind: Kind, batch: Any
) -> tuple[Any, Any]:
    """The network's ``(inputs, targets)`` on ``batch``: the module's ``step`` run until
    it calls the loss (the pipeline is not run).

    Raises:
        ConfigError: the step failed, or never reached the loss, in one sentence.
    """
    try:
        with steps.step(kind, dry=True):
            getattr(module, step)(batch, 0)
    except SampleFound as found:
        return found.inputs, found.targets
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"PipelineStrategy ran {step} on a first batch to find the network's inputs "
            f"and it raised {one_line(exc, 120)}; pass sample=(inputs, targets) to the "
            f"strategy"
        ) from exc
    raise ConfigError(
        f"{step} never passed self.{steps.module_attr}'s output to self.{steps.loss_attr}; "
        f"compute the loss as self.{steps.loss_attr}(self.{steps.module_attr}(inputs), "
        f"targets) (or self.{steps.module_attr}(**batch).loss)"
    )


def check_optimizers(optimizers: Sequence[Any], pipe: Pipeline, module_attr: str) -> None:
    """One optimizer, over this rank's parameters.

    Raises:
        ConfigError: several optimizers, or one holding other ranks' parameters.
    """
    if len(optimizers) != 1:
        raise ConfigError(
            f"PipelineStrategy steps one optimizer, but configure_optimizers gave "
            f"{len(optimizers)}; return one optimizer over self.parameters()"
        )
    local = {id(p) for p in pipe.parameters()}
    groups = optimizers[0].param_groups
    foreign = sum(1 for g in groups for p in g["params"] if id(p) not in local)
    if foreign:
        raise ConfigError(
            f"the optimizer holds {foreign} parameters that are not this rank's stages'; "
            f"build it in configure_optimizers from self.parameters() (or "
            f"self.{module_attr}.parameters())"
        )
