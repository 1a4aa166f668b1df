"""The step interceptor: inside a LightningModule's step, ``self.model(inputs)`` records
the inputs and ``self.loss_fn(output, targets)`` runs the whole batch as one pipeline step.

A step in progress is a :class:`StepCall`: its :class:`Kind`, whether it is a dry run that
only looks for the network's inputs (:class:`SampleFound`), and what its network call left
for the loss. Outside a step there is none, and the network refuses to be called.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.integrations._lightning_parts import PipelineOutput, Scaled, rows, step_inputs
from conveyor.pipeline import Pipeline
from conveyor.runtime.step_grads import StepGradients


class Kind(enum.Enum):
    """Which pipeline step a LightningModule step becomes."""

    TRAIN = "train"  # training_step: pipe.train_step
    EVAL = "eval"  # validation_step, test_step: pipe.eval_step
    PREDICT = "predict"  # predict_step: pipe.predict


class LossStyle(enum.Enum):
    """Where a step's loss comes from."""

    FN = "fn"  # the module's loss_fn(output, targets)
    TOKEN = "token"  # the network's own token loss: its labels are among its inputs
    OWN = "own"  # the network's own loss, read from its output


@dataclass
class StepCall:
    """One LightningModule step in progress.

    Attributes:
        kind: The pipeline step it becomes.
        factor: Lightning's gradient accumulation (training; 1 otherwise): the step's loss
            counts ``1 / factor``.
        dry: A dry run on a first batch that stops (:class:`SampleFound`) once the
            network's inputs and targets are known.
        pending: The network's output waiting for the loss.
        ran: Whether the pipeline step ran.
    """

    kind: Kind
    factor: int = 1
    dry: bool = False
    pending: PipelineOutput | None = None
    ran: bool = False


class SampleFound(BaseException):
    """Raised inside a dry run once the network's inputs and targets are known (a
    BaseException: a user's ``except Exception`` does not swallow it)."""

    def __init__(self, inputs: Any, targets: Any) -> None:
        super().__init__()
        self.inputs = inputs
        self.targets = targets


class Interceptor:
    """Routes the network and loss calls of a LightningModule's steps to the pipeline
    (the stand-ins' :class:`~conveyor.integrations._lightning_parts.Runner`).

    Args:
        module_attr: The LightningModule's attribute holding the network (for messages).
        loss_attr: The attribute holding the loss (for messages).
    """

    def __init__(self, module_attr: str, loss_attr: str) -> None:
        self.module_attr = module_attr
        self.loss_attr = loss_attr
        self.call: StepCall | None = None
        self.pipe: Pipeline | None = None
        self.loss: Scaled | None = None
        self.style = LossStyle.FN
        self.context: Context | None = None
        self._held: StepGradients | None = None  # the last training step's, until backward

    def use_loss(self, loss: Scaled, style: LossStyle) -> None:
        """The pipeline's loss and where it comes from (before a dry run reads inputs)."""
        self.loss, self.style = loss, style

    def use_pipeline(self, pipe: Pipeline, context: Context) -> None:
        """The pipeline the steps run on."""
        self.pipe, self.context = pipe, context

    @contextlib.contextmanager
    def step(self, kind: Kind, factor: int = 1, dry: bool = False) -> Iterator[StepCall]:
        """Calls to the network inside ``with`` belong to one step of ``kind``."""
        self.call = StepCall(kind, factor, dry)
        try:
            yield self.call
        finally:
            self.call = None

    def run(self, name: str, kind: Kind, step: Any, factor: int = 1) -> Any:
        """``step()`` (the module's ``name`` step) with its network calls routed here.

        Raises:
            ConfigError: a training or evaluation step that never ran the pipeline.
        """
        with self.step(kind, factor) as call:
            out = step()
            if kind is not Kind.PREDICT and not call.ran:
                raise ConfigError(
                    f"{name} did not compute its loss as self.{self.loss_attr}(self."
                    f"{self.module_attr}(inputs), targets) (or self.{self.module_attr}(**batch)"
                    f".loss), so the pipeline did not run; compute it so"
                )
        return out

    def network_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``self.model(...)`` inside a step.

        Returns:
            A :class:`PipelineOutput` waiting for the loss; in ``predict_step`` the whole
            batch's output, on every pipeline rank of the replica.

        Raises:
            ConfigError: a call outside a step, or a second call in one step.
            SampleFound: a dry run of ``predict_step`` (its inputs are all it needs).
        """
        call = self.call
        if call is None:
            raise ConfigError(
                f"self.{self.module_attr} is split over the pipeline's ranks; call it only "
                f"inside training_step, validation_step, test_step or predict_step"
            )
        inputs = step_inputs(args, kwargs)
        if call.kind is Kind.PREDICT:
            if call.dry:
                raise SampleFound(inputs, None)
            return self._predict(inputs)
        if call.pending is not None or call.ran:
            raise ConfigError(
                f"self.{self.module_attr} was called twice in one step; a pipeline step runs "
                f"the network once per batch"
            )
        call.pending = PipelineOutput(self, inputs)
        return call.pending

    def loss_call(self, output: PipelineOutput, targets: Any) -> torch.Tensor:
        """Run the step whose output reached the loss.

        Returns:
            The whole (global) batch's loss, detached, the same on every rank; a training
            step's gradients wait for :meth:`backward`.

        Raises:
            ConfigError: an output of another step, or missing targets.
            SampleFound: a dry run (the inputs and targets are all it needs).
        """
        call = self.call
        if call is None or output is not call.pending or output.used:
            raise ConfigError(
                "a network output from another step (or used twice) reached the loss; compute "
                "the loss once per step from that step's output"
            )
        output.used = True
        inputs, targets = self._inputs_and_targets(output.inputs, targets)
        if call.dry:
            raise SampleFound(inputs, targets)
        pipe, loss = self.pipe, self.loss
        assert pipe is not None and loss is not None
        loss.factor = call.factor
        try:
            if call.kind is Kind.TRAIN:
                result = self._train_step(pipe, inputs, targets)
            else:
                result = pipe.eval_step(inputs, targets)
        finally:
            loss.factor = 1
        call.ran = True
        return result * call.factor if call.factor != 1 else result

    def _inputs_and_targets(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """The pipeline step's inputs and targets for the loss's style."""
        if self.style is LossStyle.FN:
            if targets is None:
                raise ConfigError(f"self.{self.loss_attr}(output, targets) needs the targets")
            return inputs, targets
        if not isinstance(inputs, Mapping):
            raise ConfigError(
                f"a network computing its own loss takes keyword inputs with its labels; "
                f"call self.{self.module_attr}(**batch)"
            )
        inputs = dict(inputs)
        if self.style is LossStyle.TOKEN:
            return inputs, inputs.pop("labels")
        return inputs, torch.zeros(rows(inputs))

    def _train_step(self, pipe: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        """``pipe.train_step``, its gradients held apart until :meth:`backward`: Lightning
        zeroes the gradients between a step and its backward."""
        params = list(pipe.parameters())
        earlier = StepGradients(params)
        earlier.put_aside()
        try:
            loss = pipe.train_step(inputs, targets)
            held = StepGradients(params)
            held.put_aside()  # this step's: .grad None until backward adds them
        finally:
            earlier.give_back()
        self._held = held
        return loss

    def backward(self) -> None:
        """Add the last training step's gradients to ``.grad`` (what Lightning left)."""
        held, self._held = self._held, None
        if held is not None:
            held.add_back()

    def _predict(self, inputs: Any) -> Any:
        """``pipe.predict`` on every pipeline rank of the replica (sent from the last)."""
        pipe, ctx = self.pipe, self.context
        assert pipe is not None and ctx is not None
        output = pipe.predict(inputs)
        if ctx.distributed and ctx.pp_size > 1:
            box = [output]
            source = ctx.global_rank(pipe.schedule.placement[-1])
            dist.broadcast_object_list(box, src=source, group=ctx.pp_group)
            output = box[0]
        return output
