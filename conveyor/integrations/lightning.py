"""Lightning users train through a conveyor pipeline by choosing a strategy.

``L.Trainer(strategy=PipelineStrategy(pp=2), devices=2)`` splits the LightningModule's
network (``self.model``) into pipeline stages, one process each, and runs every batch of
``training_step`` / ``validation_step`` / ``test_step`` as one pipeline step: the
LightningModule's ``self.loss_fn(self.model(inputs), targets)`` (or ``self.model(**batch)
.loss`` for a network computing its own loss) is the whole batch's loss, with the unsplit
network's gradients. Lightning's loop, optimizers, schedulers, gradient accumulation and
clipping, logging, callbacks and checkpoints work as they do on one device; checkpoints
are conveyor's (each rank writes its part, under the network's own names). The guide:
docs/guide/lightning.md.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from conveyor.checkpoint import load as load_checkpoint
from conveyor.checkpoint import save as save_checkpoint
from conveyor.context import Context, backend_timeout, in_torchrun, init
from conveyor.errors import ConfigError, one_line
from conveyor.integrations._hf_model import gather_state_dict
from conveyor.integrations._lightning_parts import (
    OutputLoss,
    PipelineLoss,
    PipelineNetwork,
    PipelineOutput,
    Scaled,
    rows,
    step_inputs,
)
from conveyor.losses import model_token_loss
from conveyor.pipeline import Pipeline
from conveyor.weights import has_meta

__all__ = ["TRAINER_STATE", "PipelineStrategy"]

TRAINER_STATE = "lightning.pt"
"""The file in a checkpoint directory with Lightning's own state (loops, callbacks, LR
schedulers, epoch, hyperparameters); the model and optimizer are conveyor's checkpoint
beside it."""

_NOT_OPTIONS = {
    "self": "",
    "model": "the network is the LightningModule's attribute (module_attr=)",
    "loss_fn": "set the LightningModule's loss_fn attribute (None: the network's own loss)",
    "context": "pass pp=, dp= (and conveyor.init's other keywords) to the strategy",
    "autocast": "use L.Trainer(precision='bf16-mixed')",
}


def _keywords(function: Callable[..., Any]) -> list[str]:
    """The keyword parameters of ``function``."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in inspect.signature(function).parameters.items() if p.kind in kinds]


class _SampleFound(BaseException):
    """Raised inside a dry run of a step once the network's inputs and targets are known
    (a BaseException: a user's ``except Exception`` does not swallow it)."""

    def __init__(self, inputs: Any, targets: Any) -> None:
        super().__init__()
        self.inputs = inputs
        self.targets = targets


class _Launcher(_MultiProcessingLauncher):
    """Lightning's spawn / fork launcher; the main process gets the whole trained network
    (gathered from every stage), not rank 0's stages alone. A network built on the meta
    device is not gathered (no process may hold it whole): its weights are in the
    checkpoints."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        strategy = trainer.strategy
        assert isinstance(strategy, PipelineStrategy)
        # the same answer on every rank: each keeps the other ranks' stages on meta
        gather = trainer.state.fn == TrainerFn.FITTING and not strategy.network_on_meta()
        whole = strategy.whole_state_dict() if gather else {}
        if strategy.local_rank != 0:
            return None
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None and not gather:
            output = output._replace(weights_path=None)  # nothing for the main process
        if output is not None and output.weights_path is not None:
            prefix = f"{strategy.module_attr}."
            self._strategy.checkpoint_io.save_checkpoint(
                {prefix + k: v for k, v in whole.items()}, output.weights_path
            )
        return output


class PipelineStrategy(ParallelStrategy):
    """A Lightning strategy that trains the LightningModule's network as a conveyor pipeline.

    The LightningModule keeps its network in ``self.model`` and its loss in
    ``self.loss_fn`` (``(output, targets) -> scalar``, a pair ``(total, count)``, or
    None / absent when the network computes its own loss from its inputs, like a
    transformers model given ``labels``); its steps compute the loss as
    ``self.loss_fn(self.model(inputs), targets)`` (or ``self.model(**batch).loss``). That
    value is the whole (global) batch's loss, the same on every rank.

    Args:
        pp: Pipeline ranks per replica (default: the processes // (dp * tp)).
        dp: Data-parallel replicas; each reads its own shard of the data.
        module_attr: The LightningModule's attribute holding the network.
        loss_attr: The LightningModule's attribute holding the loss.
        start_method: How Lightning starts ``devices`` processes when no launcher (torchrun)
            did: ``"popen"`` (runs the script again per process, as Lightning's DDP),
            ``"spawn"`` or ``"fork"``.
        process_group_backend: ``"gloo"`` or ``"nccl"`` (default: the device's).
        **pipeline_options: :func:`conveyor.init`'s keywords (``tp``, ``timeout``: seconds
            any wait on another rank may take, the process group's too, ...) and
            :class:`conveyor.Pipeline`'s (``microbatches`` (default: ``pp``),
            ``schedule``, ``chunks``, ``balance``, ``fsdp``, ``tp_plan``, ``compile``,
            ``recompute``, ``sample``, ...).

    Raises:
        ConfigError: an option the strategy does not take, in one sentence.
    """

    strategy_name = "conveyor_pipeline"

    def __init__(
        self,
        pp: int | None = None,
        dp: int = 1,
        *,
        module_attr: str = "model",
        loss_attr: str = "loss_fn",
        start_method: str = "popen",
        process_group_backend: str | None = None,
        **pipeline_options: Any,
    ) -> None:
        super().__init__()
        refused = sorted(set(pipeline_options) & set(_NOT_OPTIONS))
        if refused:
            name = refused[0]
            raise ConfigError(f"PipelineStrategy does not take {name}=; {_NOT_OPTIONS[name]}")
        init_keys = [k for k in _keywords(init) if k not in ("pp", "dp")]
        pipe_keys = [k for k in _keywords(Pipeline.__init__) if k not in _NOT_OPTIONS]
        unknown = sorted(set(pipeline_options) - set(init_keys) - set(pipe_keys))
        if unknown:
            raise ConfigError(
                f"PipelineStrategy does not know {unknown}; pass conveyor.init's {init_keys} "
                f"or conveyor.Pipeline's {pipe_keys}"
            )
        if start_method not in ("popen", "spawn", "fork"):
            raise ConfigError(
                f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}"
            )
        self.init_options: dict[str, Any] = {"pp": pp, "dp": dp}
        self.init_options.update({k: v for k, v in pipeline_options.items() if k in init_keys})
        self.pipeline_options = {k: v for k, v in pipeline_options.items() if k in pipe_keys}
        self.module_attr = module_attr
        self.loss_attr = loss_attr
        self.num_nodes = 1
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self.context: Context | None = None
        self.pipe: Pipeline | None = None
        self._loss: Scaled | None = None
        self._style = "fn"  # "fn": the user's loss_fn; "token" / "own": the network's own
        self._mode: str | None = None  # train, eval, predict; sample-<mode>: finding the sample
        self._pending: PipelineOutput | None = None
        self._ran = False
        self._fresh: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    # ------------------------------------------------------------------ processes
    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes on this node (Lightning's ``devices``)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether there are several processes (then the data is sharded per replica)."""
        return self.num_nodes * self.num_processes > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every pipeline rank of a replica reads that replica's shard."""
        ctx = self.context
        if ctx is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": ctx.dp_size, "rank": ctx.dp_rank}

    def _configure_launcher(self) -> None:
        """Lightning's launcher for ``devices`` processes, unless one started them; also
        refuses a precision the pipeline cannot run (here, when the Trainer is made)."""
        _autocast(self.precision_plugin)
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally or not self.is_distributed:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _Launcher(self, start_method=self._start_method)  # type: ignore[arg-type]

    def set_world_ranks(self) -> None:
        """This process's rank from the cluster environment."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        """The process group (several processes) and conveyor's context."""
        super().setup_environment()
        if self.is_distributed or in_torchrun():
            reset_seed()
            self.set_world_ranks()
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(
                self.root_device
            )
            assert self.cluster_environment is not None
            kwargs: dict[str, Any] = {}
            if self.root_device.type != "cpu":  # bound to its GPU at once, as conveyor.init
                kwargs["device_id"] = self.root_device
            seconds = self.init_options.get("timeout")
            if seconds is not None:  # else Lightning's; conveyor's own waits keep theirs
                kwargs["timeout"] = timedelta(seconds=backend_timeout(backend, float(seconds)))
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
        elif self.root_device.type != "cpu":
            raise ConfigError(
                f"one process runs every pipeline stage on the CPU, not on "
                f"{self.root_device}; give the Trainer devices=pp*dp to run a stage per "
                f"{self.root_device.type} device, or accelerator='cpu'"
            )
        self.context = init(**self.init_options)

    # ------------------------------------------------------------------ the pipeline
    def setup(self, trainer: pl.Trainer) -> None:
        """Split the network into the pipeline (on the first call), then the optimizers."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ConfigError(
                "PipelineStrategy runs Lightning's automatic optimization (the pipeline does "
                "forward and backward in one step); remove automatic_optimization = False and "
                "return the loss from training_step"
            )
        stand_in = getattr(module, self.module_attr, None)
        if not (isinstance(stand_in, PipelineNetwork) and stand_in.__dict__["runner"] is self):
            self._build(trainer, module)  # first use of this module here (else: its pipeline)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        clip = self.precision_plugin
        clip.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _build(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Make the pipeline from the module's network and loss, and put the stand-ins in."""
        network = getattr(module, self.module_attr, None)
        if isinstance(network, PipelineNetwork):  # another strategy's: split it anew
            network = network.__dict__["original"]
        if not isinstance(network, nn.Module):
            raise ConfigError(
                f"PipelineStrategy splits the LightningModule's network, found in "
                f"self.{self.module_attr}; put the network there (an nn.Module), or name its "
                f"attribute with PipelineStrategy(module_attr=...)"
            )
        inside = {id(p) for p in network.parameters()}
        mine = f"{self.module_attr}."
        named = module.named_parameters()
        outside = [n for n, p in named if id(p) not in inside and not n.startswith(mine)]
        if outside:
            raise ConfigError(
                f"PipelineStrategy trains self.{self.module_attr} only, but the "
                f"LightningModule has parameters outside it (e.g. {outside[:3]}); move "
                f"those layers into self.{self.module_attr}"
            )
        user_loss = getattr(module, self.loss_attr, None)
        if isinstance(user_loss, PipelineLoss):
            user_loss = user_loss.__dict__["loss_fn"]
        token = model_token_loss(network) if user_loss is None else None
        loss: Any = user_loss if user_loss is not None else token
        loss = loss if loss is not None else OutputLoss()
        self._style = "fn" if user_loss is not None else "token" if token is not None else "own"
        self._loss = Scaled(loss)
        config: Any = getattr(network, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False  # a key/value cache cannot cross stages
        stand_in = PipelineNetwork(self, network)
        setattr(module, self.module_attr, stand_in)
        if user_loss is not None:
            setattr(module, self.loss_attr, PipelineLoss(self, user_loss))
        ctx = self.context
        assert ctx is not None
        options = dict(self.pipeline_options)
        options.setdefault("microbatches", ctx.pp_size)
        autocast = _autocast(self.precision_plugin)
        pipe = Pipeline(network, loss_fn=self._loss, context=ctx, autocast=autocast, **options)
        if not _is_split(pipe):  # a graph captured on a batch: find one
            sample = self._sample(trainer, module)
            options["sample"] = sample
            pipe = Pipeline(network, loss_fn=self._loss, context=ctx, autocast=autocast, **options)
        self.pipe = pipe
        stand_in.stages = nn.ModuleList(pipe.stages)

    def _check_optimizers(self) -> None:
        """One optimizer, over this rank's parameters."""
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"PipelineStrategy steps one optimizer, but configure_optimizers gave "
                f"{len(self.optimizers)}; return one optimizer over self.parameters()"
            )
        assert self.pipe is not None
        local = {id(p) for p in self.pipe.parameters()}
        groups = self.optimizers[0].param_groups
        foreign = sum(1 for g in groups for p in g["params"] if id(p) not in local)
        if foreign:
            raise ConfigError(
                f"the optimizer holds {foreign} parameters that are not this rank's stages'; "
                f"build it in configure_optimizers from self.parameters() (or "
                f"self.{self.module_attr}.parameters())"
            )

    def _sample(self, trainer: pl.Trainer, module: pl.LightningModule) -> tuple[Any, Any]:
        """The network's inputs and targets on a first batch: the module's step run until
        it calls the loss (the loader's random state is put back afterwards)."""
        fn = trainer.state.fn
        loop: Any = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
            TrainerFn.PREDICTING: trainer.predict_loop,
        }[fn]  # type: ignore[index]
        step, mode = {
            TrainerFn.FITTING: ("training_step", "sample-train"),
            TrainerFn.VALIDATING: ("validation_step", "sample-eval"),
            TrainerFn.TESTING: ("test_step", "sample-eval"),
            TrainerFn.PREDICTING: ("predict_step", "sample-predict"),
        }[fn]  # type: ignore[index]
        states = _collect_rng_states()
        try:
            loader = loop._data_source.dataloader()
            if isinstance(loader, (list, tuple)):
                loader = loader[0]
            batch = self.batch_to_device(next(iter(loader)))
        except Exception as exc:
            raise ConfigError(
                f"PipelineStrategy splits this network on a first batch but could not read "
                f"one ({one_line(exc, 120)}); pass sample=(inputs, targets) to the strategy"
            ) from exc
        finally:
            _set_rng_states(states)
        try:
            with self._in(mode):
                getattr(module, step)(batch, 0)
        except _SampleFound as found:
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
            f"{step} never passed self.{self.module_attr}'s output to self.{self.loss_attr}; "
            f"compute the loss as self.{self.loss_attr}(self.{self.module_attr}(inputs), "
            f"targets) (or self.{self.module_attr}(**batch).loss)"
        )

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def _in(self, mode: str) -> Iterator[None]:
        """Calls to the network inside ``with`` belong to a ``mode`` step."""
        self._mode, self._pending, self._ran = mode, None, False
        try:
            yield
        finally:
            self._mode, self._pending = None, None

    def _step(self, name: str, mode: str, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The module's ``name`` step with its network calls routed to the pipeline."""
        module = self.lightning_module
        assert module is not None
        with self._in(mode):
            out = getattr(module, name)(*args, **kwargs)
            if mode != "predict" and not self._ran:
                raise ConfigError(
                    f"{name} did not compute its loss as self.{self.loss_attr}(self."
                    f"{self.module_attr}(inputs), targets) (or self.{self.module_attr}(**batch)"
                    f".loss), so the pipeline did not run; compute it so"
                )
        return out

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``; its loss is the pipeline step's."""
        return self._step("training_step", "train", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``validation_step``; its loss is ``pipe.eval_step``'s."""
        return self._step("validation_step", "eval", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``test_step``; its loss is ``pipe.eval_step``'s."""
        return self._step("test_step", "eval", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step``; the network's output is ``pipe.predict``'s."""
        return self._step("predict_step", "predict", args, kwargs)

    def network_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``self.model(...)`` inside a step.

        Args:
            args: The call's positional inputs.
            kwargs: The call's keyword inputs.

        Returns:
            A :class:`PipelineOutput` waiting for the loss; in ``predict_step`` the whole
            batch's output, on every pipeline rank of the replica.

        Raises:
            ConfigError: a call outside a step, or a second call in one step.
        """
        mode = self._mode
        if mode is None:
            raise ConfigError(
                f"self.{self.module_attr} is split over the pipeline's ranks; call it only "
                f"inside training_step, validation_step, test_step or predict_step"
            )
        inputs = step_inputs(args, kwargs)
        if mode == "sample-predict":
            raise _SampleFound(inputs, None)
        if mode == "predict":
            return self._predict(inputs)
        if self._pending is not None or self._ran:
            raise ConfigError(
                f"self.{self.module_attr} was called twice in one step; a pipeline step runs "
                f"the network once per batch"
            )
        self._pending = PipelineOutput(self, inputs)
        return self._pending

    def loss_call(self, output: PipelineOutput, targets: Any) -> torch.Tensor:
        """Run the step whose output reached the loss.

        Args:
            output: The step's :class:`PipelineOutput`.
            targets: The loss's targets (None for a network computing its own loss).

        Returns:
            The whole (global) batch's loss, detached, the same on every rank; training
            steps leave its gradients for :meth:`backward`.

        Raises:
            ConfigError: an output of another step, or missing targets.
        """
        if output is not self._pending or output.used:
            raise ConfigError(
                "a network output from another step (or used twice) reached the loss; compute "
                "the loss once per step from that step's output"
            )
        output.used = True
        inputs = output.inputs
        if targets is None and self._style == "fn":
            raise ConfigError(f"self.{self.loss_attr}(output, targets) needs the targets")
        if self._style != "fn":
            if not isinstance(inputs, Mapping):
                raise ConfigError(
                    f"a network computing its own loss takes keyword inputs with its labels; "
                    f"call self.{self.module_attr}(**batch)"
                )
            inputs = dict(inputs)
            targets = inputs.pop("labels") if self._style == "token" else torch.zeros(rows(inputs))
        mode = self._mode or ""
        if mode.startswith("sample-"):
            raise _SampleFound(inputs, targets)
        pipe, loss = self.pipe, self._loss
        assert pipe is not None and loss is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        factor = int(trainer.accumulate_grad_batches) if mode == "train" else 1
        loss.factor = factor
        try:
            if mode == "train":
                result = self._train_step(pipe, inputs, targets)
            else:
                result = pipe.eval_step(inputs, targets)
        finally:
            loss.factor = 1
        self._ran = True
        return result * factor if factor != 1 else result

    def _train_step(self, pipe: Pipeline, inputs: Any, targets: Any) -> torch.Tensor:
        """``pipe.train_step``, its gradients held apart until :meth:`backward`: Lightning
        zeroes the gradients between the step and its backward."""
        params = list(pipe.parameters())
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss = pipe.train_step(inputs, targets)
            self._fresh = [(p, p.grad) for p in params]
        finally:
            for p, grad in zip(params, earlier, strict=True):
                p.grad = grad
        return loss

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

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Only Lightning's hooks: the pipeline step already ran the backward."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        fresh, self._fresh = self._fresh, []
        with torch.no_grad():
            for p, grad in fresh:
                if grad is None:
                    continue
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the whole network's gradient norm, over every stage and replica."""
        assert self.pipe is not None
        self.pipe.clip_grad_norm_(float(clip_val))

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        """Wait for every process."""
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every process."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the processes (``self.log(..., sync_dist=True)``)."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        """The module (this rank's stages) on this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the pipeline, which ``setup`` makes."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer's state comes from conveyor's checkpoint."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the network's state goes into conveyor's checkpoint."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing: the optimizer's state goes into conveyor's checkpoint."""
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the network."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizer."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Write a checkpoint directory: conveyor's checkpoint of the network (and the
        optimizer), each rank its part, and Lightning's state in :data:`TRAINER_STATE`.

        Args:
            checkpoint: Lightning's checkpoint dict (its ``state_dict`` and
                ``optimizer_states`` are left to conveyor's checkpoint).
            filepath: The directory (every rank takes rank 0's).
            storage_options: Not taken.
        """
        if storage_options is not None:
            raise ConfigError(
                "PipelineStrategy writes conveyor checkpoints without a CheckpointIO; drop "
                "storage_options"
            )
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and path.is_file():
            path.unlink()  # a file of that name (Lightning's own format): replaced
        self.barrier()
        state = dict(checkpoint)
        state.pop("state_dict", None)
        optimizer = self.optimizers[0] if "optimizer_states" in state and self.optimizers else None
        state.pop("optimizer_states", None)
        assert self.pipe is not None
        step = state.get("global_step")
        save_checkpoint(self.pipe, path, optimizer, step=int(step) if step is not None else None)
        if self.is_global_zero:
            tmp = path / f"{TRAINER_STATE}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, path / TRAINER_STATE)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load a checkpoint directory :meth:`save_checkpoint` wrote into the pipeline (and
        the optimizer, when fitting).

        Args:
            checkpoint_path: The directory (any split, schedule or process count saved it).
            weights_only: Unused (Lightning's state is this library's own file).

        Returns:
            Lightning's state (loops, callbacks, LR schedulers, ...).
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.pipe is not None
        optimizer = self.optimizers[0] if self.optimizers else None
        load_checkpoint(self.pipe, path, optimizer)
        state: dict[str, Any] = torch.load(path / TRAINER_STATE, weights_only=False)
        state["state_dict"] = {}
        return state

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    def network_on_meta(self) -> bool:
        """Whether any tensor of the network this rank was given is still on the meta
        device (built under ``conveyor.empty_weights``, other ranks' stages unset)."""
        assert self.lightning_module is not None
        stand_in = getattr(self.lightning_module, self.module_attr)
        return has_meta([stand_in.__dict__["original"]])

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole network's state dict, gathered from every stage. A collective: call
        it on every rank.

        Returns:
            The state dict under the network's own names on rank 0, ``{}`` elsewhere.
        """
        assert self.pipe is not None and self.lightning_module is not None
        stand_in = getattr(self.lightning_module, self.module_attr)
        return gather_state_dict(self.pipe, stand_in.__dict__["original"])

    def teardown(self) -> None:
        """Lightning's teardown (the process group stays for conveyor's exit)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _is_split(pipe: Pipeline) -> bool:
    """Whether the pipeline has split its model (not waiting for a first batch)."""
    try:
        stages = pipe.stages
    except ConfigError:
        return False
    return bool(stages)


def _autocast(precision: Precision) -> torch.dtype | None:
    """The pipeline's autocast for Lightning's precision plugin, or a refusal."""
    if isinstance(precision, MixedPrecision) and precision.precision == "bf16-mixed":
        return torch.bfloat16
    if type(precision) is Precision:
        return None
    name = getattr(precision, "precision", type(precision).__name__)
    raise ConfigError(
        f"PipelineStrategy runs precision '32-true' and 'bf16-mixed' (conveyor's bfloat16 "
        f"autocast), not {name!r}; pick one of those"
    )
