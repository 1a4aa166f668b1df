"""Lightning's strategy methods over the core, for either package: ``PipelineStrategy``
is ``class PipelineStrategy(StrategyBody, ParallelStrategy)`` in each package's module,
which hands this body that package's pieces (:class:`Package`) and its launcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from conveyor.context import Context, in_torchrun, init
from conveyor.errors import ConfigError, one_line
from conveyor.integrations._lightning.building import build, check_optimizers, dry_run
from conveyor.integrations._lightning.options import StrategyOptions
from conveyor.integrations._lightning.package import Package
from conveyor.integrations._lightning.processes import (
    GATHER_LIMIT,
    check_one_process,
    process_group_options,
    sampler_arguments,
)
from conveyor.integrations._lightning.saving import CheckpointMethods
from conveyor.integrations._lightning.steps import Interceptor, Kind
from conveyor.integrations._lightning_parts import PipelineNetwork
from conveyor.pipeline import Pipeline


class StrategyBody(CheckpointMethods):
    """The strategy's Lightning methods (see :class:`conveyor.integrations.lightning.
    PipelineStrategy`); those of checkpoints come from :class:`CheckpointMethods`. Joined
    with a package's ``ParallelStrategy``, which comes after it in the class's bases and
    provides what is declared below for type checking."""

    package: ClassVar[Package]
    launcher_class: ClassVar[Callable[..., Any]]  # the package module's spawn / fork launcher

    if TYPE_CHECKING:  # Lightning's Strategy's members this body uses
        accelerator: Any
        precision_plugin: Any
        optimizers: Any
        checkpoint_io: Any
        cluster_environment: Any
        parallel_devices: Any
        model: Any
        _launcher: Any

        @property
        def lightning_module(self) -> Any: ...
        @property
        def local_rank(self) -> int: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def node_rank(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        def setup_optimizers(self, trainer: Any) -> None: ...
        def setup_precision_plugin(self) -> None: ...
        def batch_to_device(
            self, batch: Any, device: Any = None, dataloader_idx: int = 0
        ) -> Any: ...  # fmt: skip

    def __init__(
        self,
        pp: int | None = None,
        dp: int = 1,
        *,
        module_attr: str = "model",
        loss_attr: str = "loss_fn",
        start_method: str = "popen",
        process_group_backend: str | None = None,
        gather_limit: int = GATHER_LIMIT,
        **pipeline_options: Any,
    ) -> None:
        super().__init__()  # the package's ParallelStrategy, next in the strategy's MRO
        if isinstance(gather_limit, bool) or not isinstance(gather_limit, int) or gather_limit < 0:
            raise ConfigError(
                f"gather_limit is a number of bytes (an int >= 0), got {gather_limit!r}; pass "
                f"0 to hand every network back through a checkpoint"
            )
        options = StrategyOptions.sort(pp, dp, start_method, pipeline_options)
        self.init_options = options.init_options
        self.pipeline_options = options.pipeline_options
        self.module_attr = module_attr
        self.loss_attr = loss_attr
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self.gather_limit = gather_limit
        self.num_nodes = 1
        self.context: Context | None = None
        self.pipe: Pipeline | None = None
        self.steps = Interceptor(module_attr, loss_attr)

    # ------------------------------------------------------------------ processes
    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        device: torch.device = self.parallel_devices[self.local_rank]
        return device

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
        replicas, rank = sampler_arguments(self.context)
        return {"num_replicas": replicas, "rank": rank}

    def _configure_launcher(self) -> None:
        """Lightning's launcher for ``devices`` processes, unless one started them; also
        refuses a precision the pipeline cannot run (here, when the Trainer is made)."""
        self.autocast()
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally or not self.is_distributed:
            return
        if self.start_method == "popen":
            self._launcher = self.package.script_launcher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = type(self).launcher_class(self, start_method=self.start_method)

    def set_world_ranks(self) -> None:
        """This process's rank from the cluster environment."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self.package.rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """This process's device, the process group (several processes) and conveyor's
        context."""
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)  # Lightning's Strategy's own
        if self.is_distributed or in_torchrun():
            self.package.reset_seed()
            self.set_world_ranks()
            device = self.root_device
            backend = self.process_group_backend or self.package.default_backend(device)
            options = process_group_options(device, backend, self.init_options.get("timeout"))
            self.package.init_process_group(self.cluster_environment, backend, **options)
        else:
            check_one_process(self.root_device)
        self.context = init(**self.init_options)

    def autocast(self) -> torch.dtype | None:
        """The pipeline's autocast for Lightning's precision plugin.

        Raises:
            ConfigError: a precision other than ``32-true`` and ``bf16-mixed``.
        """
        precision = self.precision_plugin
        package = self.package
        name = getattr(precision, "precision", type(precision).__name__)
        if isinstance(precision, package.mixed_precision) and name == "bf16-mixed":
            return torch.bfloat16
        if type(precision) is package.precision:
            return None
        raise ConfigError(
            f"PipelineStrategy runs precision '32-true' and 'bf16-mixed' (conveyor's "
            f"bfloat16 autocast), not {name!r}; pick one of those"
        )

    # ------------------------------------------------------------------ the pipeline
    def setup(self, trainer: Any) -> None:
        """Split the network into the pipeline (on the first call), then the optimizers."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ConfigError(
                "PipelineStrategy runs Lightning's automatic optimization (the pipeline does "
                "forward and backward in one step); remove automatic_optimization = False and "
                "return the loss from training_step"
            )
        stand_in = getattr(module, self.module_attr, None)
        if not (isinstance(stand_in, PipelineNetwork) and stand_in.runner is self.steps):
            assert self.context is not None  # first use of this module here
            self.pipe = build(module, self.steps, self.context, self.pipeline_options,
                              self.autocast(), lambda: self._sample(trainer, module))  # fmt: skip
        self.model_to_device()
        if trainer.state.fn == self.package.trainer_fn.FITTING:
            self.setup_optimizers(trainer)
            assert self.pipe is not None
            check_optimizers(self.optimizers, self.pipe, self.module_attr)
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _sample(self, trainer: Any, module: Any) -> tuple[Any, Any]:
        """The network's inputs and targets on a first batch: the module's step run until
        it calls the loss (the loader's random state is put back afterwards)."""
        fn = self.package.trainer_fn
        loop, step, kind = {
            fn.FITTING: (trainer.fit_loop, "training_step", Kind.TRAIN),
            fn.VALIDATING: (trainer.validate_loop, "validation_step", Kind.EVAL),
            fn.TESTING: (trainer.test_loop, "test_step", Kind.EVAL),
            fn.PREDICTING: (trainer.predict_loop, "predict_step", Kind.PREDICT),
        }[trainer.state.fn]
        states = self.package.rng_states()
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
            self.package.set_rng_states(states)
        return dry_run(self.steps, module, step, kind, batch)

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``; its loss is the pipeline step's."""
        module = self.lightning_module
        factor = int(module.trainer.accumulate_grad_batches)
        step = module.training_step
        return self.steps.run("training_step", Kind.TRAIN, lambda: step(*args, **kwargs), factor)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``validation_step``; its loss is ``pipe.eval_step``'s."""
        step = self.lightning_module.validation_step
        return self.steps.run("validation_step", Kind.EVAL, lambda: step(*args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``test_step``; its loss is ``pipe.eval_step``'s."""
        step = self.lightning_module.test_step
        return self.steps.run("test_step", Kind.EVAL, lambda: step(*args, **kwargs))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step``; the network's output is ``pipe.predict``'s."""
        step = self.lightning_module.predict_step
        return self.steps.run("predict_step", Kind.PREDICT, lambda: step(*args, **kwargs))

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning's hooks, and the training step's gradients added to ``.grad``: the
        pipeline step already ran the backward."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.steps.backward()
        loss: torch.Tensor = self.precision_plugin.post_backward(closure_loss, module)
        return loss

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the whole network's gradient norm, over every stage and replica."""
        assert self.pipe is not None
        self.pipe.clip_grad_norm_(float(clip_val))

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        """Wait for every process."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every process."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the processes (``self.log(..., sync_dist=True)``)."""
        if isinstance(tensor, torch.Tensor):
            return self.package.reduce(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        """The module (this rank's stages) on this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown (the process group stays for conveyor's exit)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
