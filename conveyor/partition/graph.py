"""Split any model that can be captured as a graph into stages along its data flow.

The model is captured by :mod:`conveyor.partition.capture` (``torch.fx``, or
``torch.export`` on a sample when fx cannot). The graph's *layers*
(:mod:`conveyor.partition.layers`) are what ``balance=`` counts and where automatic cuts
go: leaf-module calls (under export, the run of operations one leaf module made) and
operations that read a parameter directly. Every node gets a stage
(:mod:`conveyor.partition.assign`): a layer's from the annotations or the cut, any other
node the latest stage among its inputs. Then each stage becomes a ``GraphModule`` of its
nodes (:mod:`conveyor.partition.stage_modules`):

- stage 0 takes the model's own arguments; stage s > 0 takes one argument, the tuple stage
  s - 1 returned, and unpacks it;
- a non-last stage returns a tuple of every value a later stage needs, in graph order:
  tensors, pytrees of them, and non-tensor values (``x.size(1)``) as they are. A value used
  two stages later is relayed through the stages between, so each stage talks only to the
  next and gradients flow back along every tensor;
- values made only from sizes, constants and buffers are made again on every stage that
  needs them rather than sent (:mod:`conveyor.partition.replicate`);
- parameter and buffer reads (``get_attr``) are repeated in every stage that uses them rather
  than sent, so a weight used on two stages (a tied embedding and head) is the same
  ``Parameter`` in both: :func:`~conveyor.partition.split.shared_parameters` finds it;
- under export, stage 0 accepts the call as the model does (positional, keyword, nested)
  and the last stage returns the model's own output type (a ``ModelOutput``, a dict).

Without annotations or ``balance`` the cuts minimise the largest stage's parameter count
while preferring cuts that go through few modules (between the blocks of a
``ModuleList``/``Sequential`` rather than inside one) and send few bytes
(:func:`conveyor.partition.cuts.balance_cuts`).

Limits (those of the capture): Python branches on ``self.training`` or on shapes are fixed
at capture, so split in the mode you train in (dropout and batch norm follow
``model.train()`` / ``model.eval()`` either way).

We build the stage graphs ourselves rather than with ``torch.fx.passes.split_module``: its
submodules take one positional argument per value and live under ``submod_i.`` prefixes,
while the pipeline needs one-argument stages that relay skips and keep original names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from conveyor.partition.assign import node_stages
from conveyor.partition.capture import capture
from conveyor.partition.kept import Kept
from conveyor.partition.layers import layers
from conveyor.partition.stage_modules import build_stages


def split_graph(
    model: nn.Module,
    stages: int,
    balance: Sequence[int] | None = None,
    sample: Any = None,
    placement: Sequence[int] | None = None,
    kept: Kept | None = None,
) -> list[nn.Module]:
    """Stage modules of a capturable model, by annotations or balanced (see module doc).

    Args:
        model: The model to split.
        stages: How many stages to make.
        balance: Layers per stage; None to cut by annotations or parameter counts.
        sample: One micro-batch of the model's input, needed only when fx cannot trace the
            model and it is captured with torch.export.
        placement: The rank of each stage, so an automatic cut can give every rank
            parameters.
        kept: Modules a torch.export capture keeps whole (:mod:`conveyor.partition.kept`).

    Returns:
        One ``GraphModule`` per stage.

    Raises:
        NeedsSample: fx cannot trace the model and no sample was given.
        ConfigError: The model cannot be captured, or the annotations or ``balance`` do
            not fit ``stages``.
    """
    cap = capture(model, sample, kept)
    where = node_stages(cap, model, stages, balance, placement)
    return build_stages(cap, model, where, stages)


def layer_count(model: nn.Module, sample: Any = None) -> int:
    """How many layers ``balance=`` counts for a model split as a graph.

    Args:
        model: The model.
        sample: One micro-batch of its input, needed only when fx cannot trace it.

    Returns:
        Its number of layers.

    Raises:
        NeedsSample: fx cannot trace the model and no sample was given.
        ConfigError: The model cannot be captured.
    """
    return len(layers(capture(model, sample), model).groups)
