"""``conveyor.Trainer``: the training loop over a :class:`conveyor.Pipeline`."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from conveyor.errors import ConfigError
from conveyor.pipeline import Pipeline
from conveyor.training import resume as saved
from conveyor.training.checks import check_length, positive, shared_seed
from conveyor.training.data import Batches
from conveyor.training.evaluate import Metric, evaluate, resolve
from conveyor.training.history import FitState, History

HOOKS = ("on_fit_start", "on_step_end", "on_eval_end", "on_epoch_end", "on_fit_end")


class Callback:
    """Base class of fit callbacks: override the hooks you need.

    A callback with state to keep across a restart returns it from :meth:`state_dict`; the
    trainer stores it with each checkpoint and gives it back to :meth:`load_state_dict`
    when ``fit(resume=True)`` continues from that checkpoint.
    """

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        """Called once before the first step (after a resume has loaded the checkpoint).

        Args:
            trainer: The trainer.
            state: Where the fit stands.
        """

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Called after each optimizer step (``state.loss``, ``state.step`` are set).

        Args:
            trainer: The trainer.
            state: Where the fit stands.
        """

    def on_eval_end(self, trainer: Trainer, state: FitState) -> None:
        """Called after each evaluation (``state.metrics`` holds its values).

        Args:
            trainer: The trainer.
            state: Where the fit stands.
        """

    def on_epoch_end(self, trainer: Trainer, state: FitState) -> None:
        """Called when an epoch's last step (and its evaluation) is done.

        Args:
            trainer: The trainer.
            state: Where the fit stands.
        """

    def on_fit_end(self, trainer: Trainer, state: FitState) -> None:
        """Called once after the last step, its evaluation and its checkpoint.

        Args:
            trainer: The trainer.
            state: Where the fit stands.
        """

    def state_dict(self) -> dict[str, Any]:
        """What to keep in checkpoints (default: nothing).

        Returns:
            A picklable dict.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned when a fit resumes.

        Args:
            state: A dict :meth:`state_dict` returned.
        """


class Trainer:
    """Train a pipeline over a dataset: the loop the examples would write by hand, written once.

    Each optimizer step is ``pipe.train_step`` on one global batch, clipping by the
    whole model's gradient norm (``max_grad_norm``), ``optimizer.step()``, ``zero_grad()``
    and ``lr_scheduler.step()``. Build it the same way on every rank and call :meth:`fit`
    on every rank.

    Args:
        pipe: The pipeline to train.
        optimizer: An optimizer over ``pipe.parameters()``.
        lr_scheduler: A ``torch.optim.lr_scheduler`` scheduler stepped after every
            optimizer step (for one stepped by epoch use the :class:`LRSchedule` callback).
        callbacks: :class:`~conveyor.training.Callback` objects, called in order.
        max_grad_norm: Clip the whole model's gradient norm to this (``None``: no clipping).
        checkpoint_dir: Where checkpoints go (:func:`conveyor.save`), and where
            ``fit(resume=True)`` continues from.
        checkpoint_every: Save every this many optimizer steps (and after the last step);
            with ``checkpoint_dir`` and without this, only after the last step.

    Raises:
        ConfigError: An argument of the wrong kind or out of range.
    """

    def __init__(
        self,
        pipe: Pipeline,
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: Any = None,
        callbacks: Iterable[Callback] = (),
        max_grad_norm: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        if not callable(getattr(pipe, "train_step", None)):
            raise ConfigError(
                f"Trainer trains a conveyor.Pipeline, got {type(pipe).__name__}; build one with "
                f"conveyor.Pipeline(model, loss_fn=..., microbatches=...)"
            )
        if not callable(getattr(optimizer, "step", None)):
            raise ConfigError(
                f"optimizer must be a torch optimizer over pipe.parameters(), got "
                f"{type(optimizer).__name__}"
            )
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise ConfigError(
                f"lr_scheduler must be a torch.optim.lr_scheduler scheduler (with step()), got "
                f"{type(lr_scheduler).__name__}"
            )
        bad_norm = max_grad_norm is not None and (
            not isinstance(max_grad_norm, numbers.Real)
            or isinstance(max_grad_norm, bool)
            or not max_grad_norm > 0
        )
        if bad_norm:
            raise ConfigError(f"max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
        if checkpoint_every is not None:
            positive("checkpoint_every", checkpoint_every)
            if checkpoint_dir is None:
                raise ConfigError(
                    "checkpoint_every needs checkpoint_dir= (where the checkpoints go)"
                )
        self.pipe = pipe
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise ConfigError(
                    f"callback {cb!r} has none of the hooks {', '.join(HOOKS)}; subclass "
                    f"conveyor.training.Callback"
                )
        self.max_grad_norm = max_grad_norm
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.state: FitState | None = None
        self._train_seed = 0

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        train_data: Any,
        *,
        batch_size: int | None = None,
        epochs: int | None = None,
        max_steps: int | None = None,
        eval_data: Any = None,
        eval_every: int | None = None,
        metrics: Mapping[str, Metric | str] | Sequence[str] | None = None,
        resume: bool = False,
    ) -> History:
        """Train for ``epochs`` passes over ``train_data`` or for ``max_steps`` steps.

        Args:
            train_data: A map-style ``Dataset`` of ``(inputs, targets)`` samples (or of
                dicts of inputs holding the labels, for models that compute their loss), or
                a ``DataLoader`` over one. Each data-parallel replica reads its share of
                every global batch; ranks whose stages need neither inputs nor targets read
                nothing. A ``Dataset`` (or a ``DataLoader`` with ``shuffle=True``) is
                shuffled anew each epoch by a permutation seeded with ``(seed, epoch)``,
                the seed being rank 0's ``torch.initial_seed()`` (or the DataLoader's
                generator's), kept in checkpoints.
            batch_size: The global batch (all replicas together) when ``train_data`` or
                ``eval_data`` is a ``Dataset``; a ``Dataset``'s last partial batch of each
                epoch is left out of training.
            epochs: Passes over the data; give this or ``max_steps``.
            max_steps: Optimizer steps (resumed ones included); give this or ``epochs``.
            eval_data: Evaluation data, like ``train_data`` (kept in order, every sample
                used), evaluated every ``eval_every`` steps, else after every epoch.
            eval_every: Steps between evaluations (needs ``eval_data``).
            metrics: ``{name: function(output, targets) -> number}`` (the batch's mean; built-in
                names such as ``"accuracy"`` may stand for a function), or a list of built-in
                names. Computed on the rank holding the last stage (with ``targets`` the inputs
                when the samples carry none), sample-weighted over the evaluation data and
                reported on every rank, with the loss, in ``history.evals``.
            resume: Continue from the latest checkpoint in ``checkpoint_dir`` exactly as an
                uninterrupted run would (model, optimizer, scheduler, data order, random
                number generators); without one there, start from the beginning.

        Returns:
            The :class:`History` of this call.

        Raises:
            ConfigError: A bad argument; the message says what to do.
        """
        length = check_length(epochs, max_steps)
        if eval_every is not None:
            positive("eval_every", eval_every)
            if eval_data is None:
                raise ConfigError(
                    "eval_every needs eval_data= (the data to evaluate on); pass both or neither"
                )
        metric_fns = resolve(metrics)
        if metric_fns and eval_data is None:
            raise ConfigError("metrics are computed on eval_data; pass eval_data= with metrics=")
        if resume and self.checkpoint_dir is None:
            raise ConfigError(
                "resume=True continues from checkpoint_dir; pass Trainer(..., checkpoint_dir=...)"
            )
        pipe, ctx = self.pipe, self.pipe.context
        train = Batches(train_data, batch_size, pipe, False, shared_seed(ctx), "train_data")
        self._train_seed = train.seed
        evals = None
        if eval_data is not None:
            evals = Batches(eval_data, batch_size, pipe, True, 0, "eval_data")
        per_epoch = train.steps_per_epoch
        total = length if epochs is None else length * per_epoch
        history = History()
        state = FitState(pipe, 0, 0, per_epoch, total, 0, False, history, ("loss", *metric_fns))
        self.state = state
        if resume:
            self._resume(state, train)
        history.start_step = state.step
        state.epoch = min(state.step, max(total - 1, 0)) // per_epoch
        self.optimizer.zero_grad()
        self._call("on_fit_start", state)
        saved_at = state.step if state.resumed else -1
        evaluated_at = -1
        while state.step < total:
            epoch, offset = divmod(state.step, per_epoch)
            state.epoch = epoch
            stop = min(per_epoch, offset + total - state.step)
            for inputs, targets, size in train.epoch(epoch, offset, stop):
                self._step(inputs, targets, size, state)
                if evals is not None and eval_every is not None and state.step % eval_every == 0:
                    self._evaluate(evals, metric_fns, state)
                    evaluated_at = state.step
                if state.step % per_epoch == 0:
                    if evals is not None and eval_every is None:
                        self._evaluate(evals, metric_fns, state)
                        evaluated_at = state.step
                    self._call("on_epoch_end", state)
                if self.checkpoint_every and state.step % self.checkpoint_every == 0:
                    self.save(state.step)
                    saved_at = state.step
        trained = state.step > history.start_step
        if evals is not None and eval_every is None and trained and evaluated_at != state.step:
            self._evaluate(evals, metric_fns, state)
        if self.checkpoint_dir is not None and trained and saved_at != state.step:
            self.save(state.step)
        self._call("on_fit_end", state)
        return history

    def _step(self, inputs: Any, targets: Any, size: int, state: FitState) -> None:
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0
        loss = self.pipe.train_step(inputs, targets)
        if self.max_grad_norm is not None:
            self.pipe.clip_grad_norm_(float(self.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        state.step += 1
        state.loss = float(loss)
        state.learning_rate = lr
        state.samples = size
        state.history.losses.append(state.loss)
        state.history.learning_rates.append(lr)
        self._call("on_step_end", state)

    def _evaluate(self, evals: Batches, metrics: dict[str, Metric], state: FitState) -> None:
        values = {"step": float(state.step), **evaluate(self.pipe, evals, metrics)}
        state.metrics = values
        state.history.evals.append(values)
        self._call("on_eval_end", state)

    def evaluate(
        self,
        data: Any,
        *,
        batch_size: int | None = None,
        metrics: Mapping[str, Metric | str] | Sequence[str] | None = None,
    ) -> dict[str, float]:
        """Evaluate the pipeline on ``data`` outside a fit (every rank calls it).

        Args:
            data: A ``Dataset`` or ``DataLoader``, as ``fit``'s ``eval_data``.
            batch_size: The global batch for a ``Dataset``.
            metrics: As ``fit``'s ``metrics``.

        Returns:
            ``{"loss": ..., name: ...}``, the same on every rank.

        Raises:
            ConfigError: A bad argument.
        """
        batches = Batches(data, batch_size, self.pipe, True, 0, "data")
        return evaluate(self.pipe, batches, resolve(metrics))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        """Save a checkpoint of ``step`` to ``checkpoint_dir`` (every rank calls it): the
        model and optimizer (:func:`conveyor.save`), and what an exact resume needs besides
        (:mod:`conveyor.training.resume`).

        Args:
            step: The optimizer steps done.

        Raises:
            ConfigError: The trainer has no ``checkpoint_dir``.
        """
        if self.checkpoint_dir is None:
            raise ConfigError("Trainer.save needs Trainer(..., checkpoint_dir=...)")
        saved.save(self._restorable(), self.checkpoint_dir, step, self._train_seed)

    def _resume(self, state: FitState, train: Batches) -> None:
        assert self.checkpoint_dir is not None
        found = saved.restore(self._restorable(), self.checkpoint_dir, state.max_steps)
        if found is None:
            return
        state.step = state.start_step = found[0]
        state.resumed = True
        if found[1] is not None:
            train.seed = self._train_seed = found[1]

    def _restorable(self) -> saved.Restorable:
        return saved.Restorable(self.pipe, self.optimizer, self.lr_scheduler, self.callbacks)

    def _call(self, hook: str, state: FitState) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if callable(method):
                method(self, state)


__all__ = ["Callback", "Trainer"]
