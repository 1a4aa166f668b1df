"""``PipelineTrainer``: ``transformers.Trainer`` training through a conveyor pipeline.

The plain trainer's loop runs unchanged (learning rate, scheduler and warm-up, epochs or
``max_steps``, gradient accumulation, logging, evaluation and save steps, callbacks,
``state.log_history``); a few hooks hand the model's work to a :class:`conveyor.Pipeline`:
``_wrap_model`` gives the loop this rank's stages (never a DDP wrapper: the pipeline
reduces over ``dp`` itself); ``create_optimizer`` builds the optimizer over this rank's
parameters with the whole model's weight-decay groups; ``training_step`` is
``pipe.train_step`` (a token-averaged loss counts tokens as the plain trainer's
``num_items_in_batch`` does); ``_clip_grad_norm`` is ``pipe.clip_grad_norm_``; the data
loaders give each replica its share of the global batches the one-process trainer draws,
read only where a stage needs them (a ``DataLoader`` over this rank's batch sampler, which
accelerate's ``skip_first_batches`` resumes mid-epoch); ``evaluation_loop`` averages
``pipe.eval_step``; ``save_model`` writes a ``from_pretrained`` directory with
``conveyor.save_pretrained`` (every rank its own tensors, nothing gathered); a checkpoint
adds ``pipeline/`` (a conveyor checkpoint of each rank's optimizer state, any layout, the
weights not stored twice) and the scheduler; resuming (``_load_optimizer_and_scheduler``)
reads both and the weights, ``load_best_model_at_end`` (``_load_best_model``) the
weights, each rank only its own tensors; the
plain trainer's own code restores the random states per rank, the ``TrainerState`` and the
data position.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import EvalLoopOutput

from conveyor.checkpoint import load_training_state, save_training_state
from conveyor.checkpoint.pretrained import write as write_pretrained
from conveyor.context import in_torchrun, init
from conveyor.errors import CheckpointError, ConfigError
from conveyor.integrations._hf_data import ReplicaLoader, replica_loader
from conveyor.integrations._hf_model import (
    Stages,
    gather_state_dict,
    read_pretrained,
    without_cache,
)
from conveyor.integrations._keywords import INIT_KEYS, pipeline_keys
from conveyor.losses import ModelTokenLoss
from conveyor.pipeline import Pipeline
from conveyor.storage import exists as checkpoint_exists

TOKEN_LOSSES = ("ForCausalLMLoss", "ForMaskedLMLoss")
# Pipeline's keywords the trainer sets itself; the others are pipeline options.
PIPELINE_KEYS = pipeline_keys(("loss_fn", "context", "sample", "autocast"))
PIPELINE_DIR = "pipeline"  # in checkpoint-N: each rank's optimizer state (conveyor's format)
SCHEDULER_NAME = "scheduler.pt"  # transformers' name for the scheduler's state
MAX_SHARD_SIZE = "50GB"  # transformers' save_pretrained default, which the plain trainer uses


class PipelineTrainer(Trainer):
    """A ``transformers.Trainer`` that trains ``model`` as a conveyor pipeline.

    Launch it like any conveyor script (``conveyor launch --nproc-per-node N train.py``, or
    ``python train.py`` for one process running every stage). ``TrainingArguments`` mean
    what they mean for the plain trainer, with ``per_device_train_batch_size`` per
    data-parallel replica (each replica's batch is cut into ``microbatches``). ``bf16``
    runs the stages under ``torch.autocast(bfloat16)``. The model computes its loss from
    ``labels`` (pass them in the dataset's features). ``save_model`` and the checkpoints
    write a ``from_pretrained`` directory without gathering the model;
    ``train(resume_from_checkpoint=path or True)`` goes on exactly where a checkpoint was
    saved (same launch: ``pp``, ``dp`` and process count).

    Args:
        model: A transformers model (or any ``nn.Module`` computing its loss from keyword
            inputs), built the same on every rank.
        args: The training arguments.
        train_dataset: A map-style dataset of feature dicts.
        eval_dataset: A map-style dataset for ``evaluate()``.
        data_collator: Makes a batch of features (default: transformers' default).
        pipeline_options: ``conveyor.init`` keywords (``pp``, ``dp``, ``tp``, ``ep``,
            ``backend``, ``timeout``) and ``conveyor.Pipeline`` keywords (``schedule``,
            ``microbatches`` (default: the smaller of 4 and the per-replica batch),
            ``chunks``, ``balance``, ``fsdp``, ``recompute``, ...).
        **kwargs: Other ``transformers.Trainer`` arguments (``callbacks``, ``optimizers``,
            ``processing_class``, ...).

    Raises:
        ConfigError: An unknown pipeline option, ``compute_metrics`` (not supported yet), or
            a train dataset needed to split the model but missing.
    """

    def __init__(
        self,
        model: nn.Module,
        args: Any,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Any = None,
        pipeline_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        options = dict(pipeline_options or {})
        unknown = sorted(set(options) - set(INIT_KEYS) - set(PIPELINE_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown pipeline_options {unknown}; use conveyor.init's {list(INIT_KEYS)} "
                f"or conveyor.Pipeline's {list(PIPELINE_KEYS)}"
            )
        if kwargs.get("compute_metrics") is not None:
            raise ConfigError(
                "PipelineTrainer does not take compute_metrics yet (outputs live on the last "
                "stage's rank); evaluate() reports eval_loss"
            )
        if in_torchrun() and args.world_size != int(os.environ["WORLD_SIZE"]):
            raise ConfigError(
                f"transformers sees {args.world_size} process(es) of the "
                f"{os.environ['WORLD_SIZE']} launched (on CPU it counts them only with "
                f"TrainingArguments(use_cpu=True)); pass use_cpu=True, or run on GPUs"
            )
        without_cache(model)
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            **kwargs,
        )
        self.whole: Any = model  # the model as given (self.model is typed loosely upstream)
        self.context = init(**{k: options.pop(k) for k in INIT_KEYS if k in options})
        options.setdefault("microbatches", min(4, self.args.per_device_train_batch_size))
        # A token-averaged loss counts its tokens as the plain trainer does (it passes
        # num_items_in_batch to such models); the labels then go to the last stage as the
        # targets. Other models compute their loss from labels in the inputs.
        loss_name = getattr(getattr(model, "loss_function", None), "__name__", "")
        self._token_loss = bool(self.model_accepts_loss_kwargs) and loss_name in TOKEN_LOSSES
        sample = self._split(self._sample(options["microbatches"]))
        self._loss = (
            ModelTokenLoss(model, getattr(self, "_loss_shifts_labels", False))
            if self._token_loss
            else None
        )
        self.pipe = Pipeline(
            model,
            loss_fn=self._loss,
            context=self.context,
            sample=sample,
            autocast=torch.bfloat16 if self.args.bf16 else None,
            **options,
        )
        self.stages = Stages(self.pipe, model)

    def _split(self, batch: Any) -> tuple[Any, Any]:
        """A batch of features as the pipeline's (inputs, targets)."""
        if not batch:  # a rank that reads no data
            return None, None
        if not self._token_loss:
            return dict(batch), None
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return inputs, batch.get("labels")

    def _sample(self, count: int) -> Any:
        """The first ``count`` training samples, collated: the pipeline splits the model on
        it (graph capture needs a sample; the optimizer needs the split)."""
        data: Any = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if data is None:
            raise ConfigError(
                "PipelineTrainer splits the model on a sample batch; pass train_dataset= (or "
                "eval_dataset=)"
            )
        return self.data_collator([data[i] for i in range(min(count, len(data)))])

    # ------------------------------------------------------------------ the model
    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """Nothing: the pipeline puts each rank's stages on its device (moving the whole
        model would hold it on one device, and cannot move meta parameters)."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        """This rank's stages: never a DDP wrapper (the pipeline reduces over dp itself)."""
        return self.stages

    def get_tp_size(self) -> int:
        """Processes that share one batch: the pipeline ranks (times tensor-parallel ranks)
        of one replica, so the total batch counts replicas only."""
        return int(self.args.world_size // self.context.dp_size)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The trainer's optimizer over this rank's parameters, with weight decay for the
        names the whole model decays."""
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(self.whole))
            named = [(n, p) for n, p in self.pipe.named_parameters() if p.requires_grad]
            decay_rate = self.args.weight_decay
            # Sharded parameters (DTensors: experts over ep, tensor-parallel weights) in
            # groups of their own: the fused and foreach optimizers step a group's tensors
            # together, and torch refuses DTensors mixed with plain tensors there.
            groups = [
                {"params": [p for n, p in named if (n in decay) is d and _sharded(p) is s],
                 "weight_decay": decay_rate if d else 0.0}
                for d in (True, False)
                for s in (False, True)
            ]  # fmt: skip
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.whole)
            self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return self.optimizer

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One batch through the pipeline; its loss as the plain trainer reports it.

        A token loss is divided by ``num_items_in_batch``, the tokens of every batch of the
        accumulation over every replica (:meth:`get_batch_samples`): the summed gradients
        are then the accumulated batches' token mean's, as the plain trainer's. Another loss
        is divided by the accumulation steps."""
        model.train()
        if num_items_in_batch is not None:
            return self.pipe.train_step(*self._split(inputs), count=int(num_items_in_batch))
        loss = self.pipe.train_step(*self._split(inputs))
        steps = max(int(getattr(self, "current_gradient_accumulation_steps", 1)), 1)
        if steps > 1 and self.accelerator.sync_gradients:
            with torch.no_grad():
                for p in self.pipe.parameters():
                    if p.grad is not None:
                        p.grad.div_(steps)
        return loss.detach().to(self.args.device) / steps

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], Any]:
        """The next ``num_batches`` batches and, for a token loss, the tokens they count
        over every replica (None otherwise). Counted where the labels are read (the last
        stage's ranks), once per replica (the cp ranks of a replica read the same rows and
        count every cp share's tokens) and summed over the world: every rank calls this at
        the same point of the loop, so the collective keeps NCCL's order."""
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if self._loss is None:
            return batches, None
        ctx = self.context
        speaks = not ctx.distributed or (
            ctx.pp_rank == self.pipe.schedule.placement[-1]
            and ctx.tp_rank == 0
            and ctx.cp_rank == 0
        )
        local = sum(
            int(self._loss.count(b["labels"])) for b in batches if b and "labels" in b
        ) if speaks else 0  # fmt: skip
        count = torch.tensor([local], dtype=torch.int64, device=ctx.device)
        if ctx.distributed:
            dist.all_reduce(count)
        return batches, int(count.item())

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.pipe.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # no clipping asked: the norm without clipping
            grad_norm = self.pipe.clip_grad_norm_(float("inf"))
        return grad_norm

    # ------------------------------------------------------------------ data
    def _loader(self, dataset: Any, per_replica: int, training: bool) -> ReplicaLoader:
        return replica_loader(
            self.args, self.pipe, dataset, self.data_collator, per_replica, training
        )

    def get_train_dataloader(self) -> Any:
        """This rank's share of the one-process trainer's training batches."""
        if self.train_dataset is None:
            raise ConfigError("training needs a train_dataset; pass train_dataset=")
        return self._loader(self.train_dataset, self._train_batch_size, training=True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """This rank's share of the evaluation batches, in order."""
        data: Any = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, str):
            named: Any = self.eval_dataset
            data = named[data]
        if data is None:
            raise ConfigError("evaluation needs an eval_dataset; pass eval_dataset=")
        return self._loader(data, self.args.per_device_eval_batch_size, training=False)

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The sample-weighted mean of ``pipe.eval_step`` over the evaluation batches."""
        total, count = 0.0, 0
        self.stages.eval()
        try:
            sizes = list(dataloader.sizes())
            for batch, size in zip(dataloader, sizes, strict=True):
                total += float(self.pipe.eval_step(*self._split(batch))) * size
                count += size
        finally:
            self.stages.train()
        metrics = {f"{metric_key_prefix}_loss": total / count if count else float("nan")}
        nothing: Any = None  # no predictions: the loss is all it reports
        return EvalLoopOutput(
            predictions=nothing, label_ids=None, metrics=metrics, num_samples=count
        )

    # ------------------------------------------------------------------ checkpoints
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Check that the checkpoint can be resumed (it has the optimizer states in
        ``pipeline/``); :meth:`_load_optimizer_and_scheduler` reads them and the weights."""
        state = os.path.join(resume_from_checkpoint, PIPELINE_DIR)
        if not checkpoint_exists(state):
            raise CheckpointError(
                f"cannot resume from {resume_from_checkpoint}: it has no {PIPELINE_DIR}/ "
                f"with each rank's optimizer state (a checkpoint saved by "
                f"another trainer, or with save_only_model=True); resume from a checkpoint "
                f"PipelineTrainer saved, or start a new run from its weights"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """This rank's weights from the checkpoint's safetensors, its optimizer state from
        ``pipeline/`` (any layout saved them), and the scheduler."""
        if checkpoint is None:
            return
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        read_pretrained(self.pipe, self.whole, checkpoint)
        load_training_state(self.pipe, os.path.join(checkpoint, PIPELINE_DIR), optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        """Every rank loads its stages' weights of the best checkpoint from its
        safetensors files (``_finalize_training`` calls it on every rank)."""
        best = self.state.best_model_checkpoint
        assert best is not None  # the plain trainer calls this only with one
        read_pretrained(self.pipe, self.whole, best)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's optimizer state in ``output_dir/pipeline`` (a conveyor checkpoint
        without the weights: ``save_model`` wrote them beside it), the scheduler on rank 0."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        save_training_state(
            self.pipe,
            os.path.join(output_dir, PIPELINE_DIR),
            optimizer,
            step=self.state.global_step,
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ saving
    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 (empty elsewhere), gathered from the
        stages under the model's own names. A collective: call it on every rank.

        Returns:
            The state dict (CPU tensors) on rank 0, ``{}`` on the other ranks.
        """
        return gather_state_dict(self.pipe, self.whole)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model where ``from_pretrained`` (and ``Pipeline(weights=...)``) reads it:
        every rank writes the tensors it holds into safetensors shards
        (``conveyor.save_pretrained``: no process gathers the whole model); rank 0 adds
        the index, the configs, the processing class and ``training_args.bin``. A
        collective: every rank calls it (the plain trainer's loop does).

        Args:
            output_dir: The directory (default: ``args.output_dir``); it may hold other
                files (checkpoints, logs).
            _internal_call: As for ``transformers.Trainer.save_model`` (no push to the Hub).
        """
        target = str(output_dir if output_dir is not None else self.args.output_dir)
        write_pretrained(self.pipe, target, MAX_SHARD_SIZE, any_directory=True)
        if self.args.should_save:
            self._save_extras(target)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_extras(self, output_dir: str) -> None:
        """What the plain trainer saves beside the weights: the processing class (or the
        collator's tokenizer) and the training arguments."""
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)  # type: ignore[union-attr]
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def _sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (a shard over a device mesh)."""
    return hasattr(p, "device_mesh")
