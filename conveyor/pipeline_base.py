"""``PipelineBase``: a model cut into stages and trained by a pipeline schedule.

Everything :class:`conveyor.Pipeline` does except ``schedule="auto"``: the planner that
resolves ``"auto"`` calibrates by running pipelines itself, so it sits above this class
(:mod:`conveyor.planning.planner` imports it) and ``Pipeline`` (:mod:`conveyor.pipeline`) above both.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.context import Context, current
from conveyor.errors import ConfigError
from conveyor.observe.trace import chrome_trace, measured_bubble, measured_costs
from conveyor.partition import shared_parameters, split_model
from conveyor.partition.annotations import annotated_stages
from conveyor.partition.capture import NeedsSample
from conveyor.partition.describe import SplitInfo, describe_split
from conveyor.runtime import microbatch
from conveyor.runtime.data_parallel import (
    DataParallel,
    global_loss,
    make_replicas_equal,
    replica_share,
)
from conveyor.runtime.engine import Engine, LossFn, Mode, StepRecord
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.recompute import autocast_dtype, recompute_stages
from conveyor.runtime.sharding import Sharded, apply_tp, local_shard
from conveyor.runtime.shared import SharedParameters
from conveyor.runtime.step_grads import StepGradients
from conveyor.runtime.timing import Timing
from conveyor.runtime.transport import collective, guarded
from conveyor.schedules import Schedule, validate
from conveyor.schedules.registry import default_chunks, get_schedule
from conveyor.simulate import simulate


class PipelineBase:
    """A model cut into stages and trained by a pipeline schedule (see
    :class:`conveyor.Pipeline`, which adds ``schedule="auto"``).

    Build it the same way on every rank. ``train_step`` returns the whole batch's loss on
    every rank and leaves in each local parameter's ``.grad`` the gradient the unsplit model
    would have; step your optimizer over ``pipe.parameters()`` as usual.

    A model ``torch.fx`` cannot trace is captured with ``torch.export`` on
    ``sample=(inputs, targets)``, or on the first batch a step gets.

    Data x pipeline parallelism (``conveyor.init(pp=P, dp=D)`` on P x D processes): each of
    the D pipeline replicas passes its own shard of the global batch (pick it with
    ``ctx.dp_rank`` / ``ctx.dp_size``; shards may differ in size). Replicas start from
    replica 0's parameters; ``train_step`` averages each stage's gradient over the replicas,
    weighted by shard size (started as soon as the stage's last backward has run), so
    ``.grad`` gets the global batch's gradient and the returned loss is the global batch's.
    ``pipe.clip_grad_norm_`` clips by the norm over the whole model.

    ``recompute=True`` (every stage) or a collection of global stage indices (0 to
    pp x chunks - 1) keeps only those stages' inputs from F to B and re-runs their forward
    at B (under the RNG state F had, so dropout repeats its masks): less activation memory
    for one more forward (not where a micro-batch's B directly follows its F: nothing would
    be freed). Modules that change state in forward (BatchNorm's running statistics) update
    twice. ``autocast=torch.bfloat16`` (or ``torch.float16``) runs every
    stage's forward and the loss under ``torch.autocast``; parameters and gradients keep
    their dtype, activations cross ranks in the autocast dtype.

    ``track_memory=True`` measures each training step's activation memory
    (:meth:`last_step_memory`); it costs a Python call per tensor autograd saves.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn | None,
        microbatches: int,
        schedule: str | Schedule = "1f1b",
        chunks: int = 1,
        balance: list[int] | None = None,
        context: Context | None = None,
        fsdp: bool | str = False,
        tp_plan: Mapping[str, Any] | None = None,
        sample: tuple[Any, Any] | None = None,
        recompute: bool | Iterable[int] = False,
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
    ) -> None:
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"chunks must be an int >= 1, got {chunks!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(
                f"loss_fn must be a function (output, target) -> scalar tensor, or None when "
                f"the model computes its own loss; got {type(loss_fn).__name__}"
            )
        if sample is not None and (not isinstance(sample, tuple) or len(sample) != 2):
            raise ConfigError(
                "sample must be a pair (inputs, targets), as train_step takes them (targets "
                "may be None with loss_fn=None)"
            )
        self.context = context if context is not None else current()
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        ranks = pipeline_ranks(self.context, model, schedule, chunks, balance)
        self._sharding = _check_sharding(self.context, fsdp, tp_plan)
        self.schedule = self._make_schedule(schedule, ranks, microbatches, chunks)
        if fsdp == "reshard" and self.schedule.split_backward:
            raise ConfigError(
                f"fsdp='reshard' frees each block's gathered weights after every use, but "
                f"{self.schedule.name!r} splits the backward and needs them from B until W; "
                f"use fsdp=True with it, or a schedule without a split backward (1f1b, gpipe, "
                f"interleaved-1f1b)"
            )
        self._model = model
        self._balance = balance
        self._options = (recompute, autocast, track_memory)
        self._ready = False  # split into stages (at construction, or on the first batch)
        first = None if sample is None else self._first_microbatch(sample[0])
        # A model fx cannot trace is captured with torch.export on the first batch.
        with contextlib.suppress(NeedsSample):
            self._build(self._split_model(first))

    def _split_model(self, sample: Any) -> list[nn.Module]:
        sched = self.schedule
        return split_model(self._model, sched.stages, self._balance, sample, sched.placement)

    def _first_microbatch(self, inputs: Any) -> Any:
        """The first micro-batch of ``inputs``: the sample a graph capture traces."""
        size = microbatch.batch_size(inputs, "inputs")
        return microbatch.split(inputs, min(self.microbatches, size), "inputs")[0]

    def _build(self, all_stages: list[nn.Module]) -> None:
        """Keep this rank's stages and set up what runs them."""
        ctx = self.context
        if self._balance is None and annotated_stages(self._model) is None:
            self._check_every_rank_trains(all_stages)
        recompute, autocast, track_memory = self._options
        held = (
            self.schedule.stages_of(ctx.pp_rank)
            if ctx.distributed
            else tuple(range(self.schedule.stages))
        )
        self._stages: dict[int, nn.Module] = {s: all_stages[s].to(ctx.device) for s in held}
        self._description = describe_split(self._model, all_stages, self.schedule.placement)
        fsdp, tp_plan = self._sharding
        # Tied weights on several ranks: copies start equal and their gradients are summed.
        ties = [
            ({s: _name_of(all_stages[s], all_stages[stages[0]], name) for s in stages}, stages)
            for name, stages in shared_parameters(all_stages)
        ]
        self._shared = SharedParameters(ties, self.schedule.placement, self._stages, ctx)
        self._shared.make_equal()
        # Data-parallel replicas start from replica 0's parameters (before any sharding).
        replicas = ctx.distributed and ctx.dp_size > 1
        if replicas:
            make_replicas_equal(self._stages, ctx)
        sharded = None
        if tp_plan is not None:
            assert ctx.mesh is not None
            if "torch.export" in self._description.how:
                raise ConfigError(
                    f"tp_plan shards modules that run as modules, but "
                    f"{self._description.model} was captured with torch.export, whose stages "
                    f"read the weights by name; tensor parallelism is not supported for such "
                    f"models yet: use fsdp=True / dp to shard them, or a model torch.fx can "
                    f"trace"
                )
            names = [n for n, _ in self._model.named_modules()] if isinstance(
                self._model, nn.Module
            ) else []
            apply_tp(self._stages, tp_plan, names, ctx.mesh["tp"], every=all_stages)
        if fsdp:
            assert ctx.mesh is not None
            _check_ties_for_fsdp(ties, self.schedule.placement)
            sharded = Sharded(self._stages, ctx.mesh["dp"], per_action=fsdp == "reshard")
        if tp_plan is not None or fsdp:
            self._shared.rebind(self._stages)
        # Without FSDP, replicas average their gradients while the pipeline drains.
        self._dp = DataParallel(self.schedule, self._stages, ctx) if replicas and not fsdp else None
        self._engine = Engine(
            self.schedule,
            self._stages,
            self.loss_fn,
            ctx,
            recompute=recompute_stages(recompute, self.schedule.stages),
            autocast=autocast_dtype(autocast),
            track_memory=track_memory,
            sharded=sharded,
            on_action=self._dp.after_action if self._dp is not None else None,
            modules={s: ", ".join(self._description.stages[s].modules) for s in held},
        )
        self._last_train: StepRecord | None = None
        self._step_grads = StepGradients(self.parameters())
        self._ready = True

    def _check_every_rank_trains(self, all_stages: list[nn.Module]) -> None:
        """An automatic split must give every rank parameters (an optimizer over none
        fails); the balance does so whenever the model has enough layers with parameters."""
        if not any(p.requires_grad for stage in all_stages for p in stage.parameters()):
            return
        sched = self.schedule
        for rank in range(sched.ranks):
            held = sched.stages_of(rank)
            if not any(p.requires_grad for s in held for p in all_stages[s].parameters()):
                raise ConfigError(
                    f"the automatic split leaves pipeline rank {rank} (stages "
                    f"{', '.join(map(str, held))}) without parameters: the model has too few "
                    f"layers with parameters for {sched.stages} stages; use fewer ranks or "
                    f"chunks, or say where to cut with balance= or pipeline_stage annotations"
                )

    def _build_from(self, inputs: Any) -> None:
        """Split a model that needs a sample on the first batch it sees.

        Every rank must capture the same graph, so the rank holding stage 0 sends its first
        micro-batch to the others (ranks may pass ``inputs=None``)."""
        ctx = self.context
        if not ctx.distributed:
            sample = None if inputs is None else self._first_microbatch(inputs)
        else:
            holder = ctx.global_rank(self.schedule.placement[0])
            box: list[Any] = [None]
            if ctx.rank == holder and inputs is not None:
                try:  # a bad batch is sent as its error, so that every rank raises it
                    first = self._first_microbatch(inputs)
                    box = [microbatch.to_device(first, torch.device("cpu"))]
                except ConfigError as error:
                    box = [error]
            guarded(
                lambda: dist.broadcast_object_list(box, src=holder, group=ctx.pp_group),
                f"rank {ctx.rank}: receiving the first batch from rank {holder} (the model is "
                f"captured on it)",
                f"rank {holder}",
            )
            sample = box[0]
            if isinstance(sample, ConfigError):
                raise sample
        if sample is None:
            raise ConfigError(
                "this model is captured with torch.export on its first batch, but the first "
                "step got inputs=None; pass the batch, or Pipeline(..., sample=(inputs, targets))"
            )
        self._build(self._split_model(sample))

    @staticmethod
    def _make_schedule(
        schedule: str | Schedule, ranks: int, microbatches: int, chunks: int
    ) -> Schedule:
        if isinstance(schedule, str):
            one = {"interleaved-1f1b": "1f1b", "looped-bfs": "gpipe"}.get(schedule)
            if chunks == 1 and one is not None:
                # chunks=1 is the default, and interleaving one chunk per rank would
                # silently be plain 1F1B / GPipe: ask for the count, as the V schedules do.
                raise ConfigError(
                    f"schedule {schedule!r} interleaves several chunks per rank; pass "
                    f"chunks={default_chunks(schedule)} (or more), or use {one!r} for one"
                )
            return get_schedule(schedule, ranks, microbatches, chunks)
        if not isinstance(schedule, Schedule):
            raise ConfigError(
                f"schedule must be a name or a conveyor.schedules.Schedule, got "
                f"{type(schedule).__name__}"
            )
        if schedule.ranks != ranks or schedule.microbatches != microbatches:
            raise ConfigError(
                f"schedule {schedule.name!r} is for {schedule.ranks} ranks and "
                f"{schedule.microbatches} micro-batches, but the pipeline has {ranks} ranks and "
                f"microbatches={microbatches}; build the schedule for the same numbers"
            )
        return validate(schedule)

    def describe(self) -> SplitInfo:
        """The split: per stage its rank, modules (original names, numbered runs folded),
        parameter count, tied weights and the values it sends on; ``str()`` of it is what
        ``print(pipe)`` shows."""
        self._require_split("pipe.describe()")
        return self._description.with_shapes(self._engine.sent_shapes)

    def __repr__(self) -> str:
        sched = self.schedule
        where = "" if self.context.distributed else ", in one process"
        head = (
            f"Pipeline({sched.name}, {sched.ranks} ranks x {sched.chunks} chunks = "
            f"{sched.stages} stages, {self.microbatches} micro-batches{where})"
        )
        if not self._ready:
            return head + "\nnot split yet: the model is captured on the first batch"
        return head + "\n" + str(self.describe())

    # ------------------------------------------------------------------ steps
    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order."""
        self._require_split("pipe.stages")
        return [self._stages[s] for s in sorted(self._stages)]

    def _require_split(self, what: str) -> None:
        if not self._ready:
            raise ConfigError(
                f"{what} needs the split, which is made on the first batch: "
                f"{type(self._model).__name__} is captured with torch.export on a sample; run "
                f"a train_step first, or pass sample=(inputs, targets) to Pipeline to split "
                f"it at construction"
            )

    def _holds(self, stage: int) -> bool:
        return stage in self._stages

    def _split(self, value: Any, what: str, needed: bool) -> list[Any] | None:
        if value is None:
            if needed:
                raise ConfigError(
                    f"this rank holds a stage that needs {what}, but got {what}=None; pass the "
                    f"batch on every rank (ranks without the first/last stage may pass None)"
                )
            return None
        parts = microbatch.split(value, self.microbatches, what)
        return [microbatch.to_device(p, self.context.device) for p in parts]

    def _begin(self, inputs: Any, targets: Any, predict: bool = False) -> None:
        """Checks of a step's arguments, and the split on the first batch if needed."""
        if not predict and self.loss_fn is None and targets is not None:
            raise ConfigError(
                "loss_fn=None takes the loss from the model's output, so targets are not used; "
                "pass the labels inside the inputs (e.g. {'input_ids': ..., 'labels': ...}) and "
                "targets=None, or give a loss_fn"
            )
        if not predict and inputs is not None and targets is not None:
            n = microbatch.batch_size(inputs, "inputs")
            t = microbatch.batch_size(targets, "targets")
            if n != t:
                raise ConfigError(
                    f"inputs hold {n} samples but targets hold {t}; pass targets for the same "
                    f"samples as the inputs (their first dimensions must match)"
                )
        if not self._ready:
            self._build_from(inputs)

    def _run(
        self, mode: Mode, inputs: Any, targets: Any, loss_scale: float = 1.0
    ) -> StepRecord:
        last = self.schedule.stages - 1
        mb_inputs = self._split(inputs, "inputs", self._holds(0))
        mb_targets = None
        if mode != "predict" and self.loss_fn is not None:
            mb_targets = self._split(targets, "targets", self._holds(last))
        record = self._engine.run(mode, mb_inputs, mb_targets, loss_scale)
        if mode == "train":  # traces and measurements show the last training step
            self._last_train = record
        return record

    def _shard_size(self, inputs: Any, targets: Any) -> int | None:
        """This replica's batch size, on the rank holding the last stage (None elsewhere)."""
        replicas = self.context.distributed and self.context.dp_size > 1
        if not replicas or not self._holds(self.schedule.stages - 1):
            return None
        if targets is not None:
            return microbatch.batch_size(targets, "targets")
        if inputs is None:
            what = "targets" if self.loss_fn is not None else "inputs"
            self._split(None, what, needed=True)  # raises the usual error
        return microbatch.batch_size(inputs, "inputs")

    def _share_loss(self, loss: torch.Tensor | None, size: int | None) -> torch.Tensor:
        if not self.context.distributed:
            assert loss is not None
            return loss
        if self.context.dp_size > 1:
            return global_loss(loss, size, self.context)
        holder = self.schedule.placement[-1]
        buf = (
            loss.detach().to(torch.float32).reshape(1)
            if loss is not None
            else torch.zeros(1, dtype=torch.float32, device=self.context.device)
        )
        source = self.context.global_rank(holder)
        collective(
            lambda: dist.broadcast(buf, source, group=self.context.pp_group, async_op=True),
            self.context.timeout,
            f"rank {self.context.rank}: sharing the loss from rank {source} (the last stage)",
            f"rank {source} or another pipeline rank",
        )
        return buf.reshape(())

    def _collective(self, start: Any, doing: str) -> None:
        """A collective over this replica's pipeline ranks, bounded by the time-out."""
        ctx = self.context
        collective(start, ctx.timeout, f"rank {ctx.rank}: {doing}", "another pipeline rank")

    def train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward of one batch; returns the batch loss (detached) on every rank.

        Gradients are added to each local parameter's ``.grad``, like ``loss.backward()``.
        With data parallelism: ``.grad`` += the shard-size-weighted mean over the replicas
        of this step's gradient, and the loss is the global batch's.
        """
        self._begin(inputs, targets)
        dp = self._dp
        size = self._shard_size(inputs, targets)
        # Reductions over ranks act on this step's gradients alone.
        isolate = dp is not None or bool(self._shared)
        if isolate:
            self._step_grads.put_aside()
        try:
            scale = 1.0
            if dp is not None:
                dp.begin(size)
            elif self._sharding[0] and self.context.dp_size > 1:
                # FSDP averages the replicas' gradients: weigh each replica's loss by its
                # shard's share of the global batch (times the replicas) for uneven shards.
                share = replica_share(size, self.context)
                scale = share * self.context.dp_size
            loss = self._run("train", inputs, targets, scale).loss
            if dp is not None:
                dp.wait()  # each .grad: this step's gradient, averaged over the replicas
            if self._shared:
                self._shared.reduce()
        except BaseException:
            if dp is not None:
                dp.abort()
            if isolate:
                self._step_grads.give_back()
            raise
        if isolate:
            self._step_grads.add_back()
        return self._share_loss(loss, size)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The batch loss without gradients, on every rank (the global batch's with data
        parallelism)."""
        self._begin(inputs, targets)
        size = self._shard_size(inputs, targets)
        loss = self._run("eval", inputs, targets).loss
        return self._share_loss(loss, size)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The whole batch's output on the rank holding the last stage, ``None`` elsewhere."""
        self._begin(inputs, None, predict=True)
        outputs = self._run("predict", inputs, None).outputs
        return microbatch.merge(outputs) if outputs else None

    # ------------------------------------------------------------------ measurement
    def last_step_timings(self) -> list[Timing]:
        """(rank, kind, stage, microbatch, start, end) of each action this process ran in
        the last training step (``eval_step`` and ``predict`` leave it), in seconds from
        the step start; start is when the action's inputs
        had arrived, so waits on other ranks are not counted as work."""
        self._require_split('pipe.last_step_timings()')
        return list(self._last_train.timings) if self._last_train is not None else []

    def last_step_waits(self) -> list[Timing]:
        """(rank, kind, stage, microbatch, start, end) of each wait of the last training
        step for another rank's output (the producer's kind, stage and micro-batch), in seconds
        from the step start."""
        self._require_split('pipe.last_step_waits()')
        return list(self._last_train.waits) if self._last_train is not None else []

    def last_step_memory(self) -> MemoryReport:
        """This process's activation memory in the last training step: bytes autograd kept
        for backward work (and the split backward kept for W) at their peak, beside the
        peak of the schedule's memory model with the sizes each F really saved. Needs
        ``Pipeline(track_memory=True)``."""
        self._require_split("pipe.last_step_memory()")
        if self._engine.meter is None:
            raise ConfigError("memory is measured only with Pipeline(..., track_memory=True)")
        record = self._last_train
        if record is None or record.memory is None:
            raise ConfigError("no training step has run yet; call train_step first")
        return record.memory

    def measured_bubble(self) -> float:
        """1 - busy time / (ranks x step time) of the last training step, over all pipeline
        ranks (of this replica, with data parallelism).

        A collective in a distributed world: call it on every rank.
        """
        self._require_split('pipe.measured_bubble()')
        timings = self.last_step_timings()
        busy = sum(end - start for *_, start, end in timings)
        wall = max((end for *_, end in timings), default=0.0)
        if self.context.distributed:
            # On the context's device: NCCL reduces device tensors only.
            device = self.context.device
            busies = torch.tensor([busy], dtype=torch.float64, device=device)
            walls = torch.tensor([wall], dtype=torch.float64, device=device)
            group = self.context.pp_group
            self._collective(
                lambda: dist.all_reduce(busies, group=group, async_op=True),
                "measuring the bubble",
            )
            self._collective(
                lambda: dist.all_reduce(walls, op=dist.ReduceOp.MAX, group=group, async_op=True),
                "measuring the bubble",
            )
            busy, wall = float(busies[0]), float(walls[0])
        ranks = self.schedule.ranks
        return 1.0 - busy / (ranks * wall) if wall > 0 else 0.0

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the last training step as one Chrome trace JSON (open it in Perfetto or
        chrome://tracing): a track per rank, an event per action and per transfer wait.

        A collective in a distributed world: call it on every rank; rank 0 writes (with data
        parallelism, the step of replica 0). The file also records the schedule's order and
        the measured and simulated bubble; ``conveyor trace FILE --png PICTURE`` draws it.
        """
        self._require_split('pipe.save_trace()')
        parts = [(self.last_step_timings(), self.last_step_waits())]
        if self.context.distributed:
            gathered: list[Any] = [None] * self.context.pp_size
            guarded(
                lambda: dist.all_gather_object(gathered, parts[0], group=self.context.pp_group),
                f"rank {self.context.rank}: gathering the trace (pipe.save_trace)",
                "another pipeline rank",
            )
            parts = gathered
        if self.context.rank != 0:
            return
        timings = [t for part, _ in parts for t in part]
        waits = [w for _, part in parts for w in part]
        sched = self.schedule
        simulated = simulate(sched, cost=measured_costs(timings, sched.stages)).bubble
        info: dict[str, object] = {
            "schedule": sched.name,
            "ranks": sched.ranks,
            "chunks": sched.chunks,
            "microbatches": sched.microbatches,
            "measured_bubble": measured_bubble(timings, sched.ranks),
            "simulated_bubble": simulated,
            "order": [[str(a) for a in program] for program in sched.actions],
        }
        with open(path, "w") as f:
            json.dump(chrome_trace(timings, waits, info), f)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradients like :func:`torch.nn.utils.clip_grad_norm_`.

        The total norm covers every stage on every rank, each parameter once (a tied
        weight with copies on several ranks; data-parallel replicas, which hold equal
        gradients after ``train_step``; FSDP and tensor-parallel shards, each counted once
        however many ranks hold it). Every local gradient is scaled by
        ``min(1, max_norm / (total + 1e-6))``; returns the total norm (float32), the same on
        every rank. ``norm_type``: any p > 0, or ``inf``. A collective in a distributed world:
        call it on every rank.
        """
        self._require_split('pipe.clip_grad_norm_()')
        p = float(norm_type)
        if not p > 0:
            raise ConfigError(
                f"norm_type must be > 0 or inf, got {norm_type!r}; use 2.0 (the default) or "
                f"float('inf')"
            )
        ctx = self.context
        params = [q for q in self.parameters() if q.grad is not None]
        copies = self._shared.copies()  # tied copies counted on another rank
        # Every rank adds its own shard of each gradient, divided by how many ranks hold
        # that same shard (replicas, and tensor-parallel ranks of an unsharded weight), so
        # the sum over the world counts each number once. In float64, the same on all ranks.
        holders = ctx.dp_size * ctx.tp_size
        parts = [
            (
                torch.linalg.vector_norm(
                    local_shard(g), p, dtype=torch.promote_types(g.dtype, torch.float32)
                ).double(),
                holders / _shards(g),
            )
            for g in (q.grad for q in params if id(q) not in copies)
            if g is not None
        ]
        zero = torch.zeros((), dtype=torch.float64, device=ctx.device)
        total: torch.Tensor
        if math.isinf(p):
            total = torch.stack([n for n, _ in parts]).max() if parts else zero
            if ctx.distributed:
                self._collective(
                    lambda: dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True),
                    "adding up the gradient norm (pipe.clip_grad_norm_)",
                )
        else:
            total = sum((n.pow(p) / count for n, count in parts), zero)
            if ctx.distributed:
                self._collective(
                    lambda: dist.all_reduce(total, async_op=True),
                    "adding up the gradient norm (pipe.clip_grad_norm_)",
                )
            total = total.pow(1.0 / p)
        total = total.float()
        scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for q in params:
            assert q.grad is not None
            grad = local_shard(q.grad)
            grad.mul_(scale.to(grad.device))
        return total

    # ------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, with their names in the original model; a weight tied
        across this rank's stages comes once."""
        if not self._ready:  # before the split (on the first batch): the whole model
            yield from self._model.named_parameters()
            return
        seen: set[int] = set()
        for stage in self.stages:
            for name, p in stage.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (pass them to the optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the model's state dict, keyed by the original names (the
        whole model's before a split made on the first batch)."""
        if not self._ready:
            return dict(self._model.state_dict())
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(stage.state_dict())
        return out

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load this rank's entries from ``state`` (a full or partial model state dict).

        Keys for stages on other ranks are ignored; with ``strict`` a missing key for a
        local stage raises.
        """
        if not self._ready:
            self._model.load_state_dict(state, strict=strict)
            return
        missing: list[str] = []
        for stage in self.stages:
            own = stage.state_dict()
            part = {k: state[k] for k in own if k in state}
            missing += [k for k in own if k not in state]
            stage.load_state_dict(part, strict=False)
        if strict and missing:
            raise ConfigError(
                f"state dict lacks {len(missing)} keys this rank needs, e.g. {missing[:3]}; "
                f"pass the model's full state dict or strict=False"
            )


def _shards(t: torch.Tensor) -> int:
    """Into how many pieces a DTensor's placements cut it (1 for a plain tensor)."""
    placements = getattr(t, "placements", ())
    mesh = getattr(t, "device_mesh", None)
    count = 1
    for dim, placement in enumerate(placements):
        # Not is_shard(): FSDP over a tensor-parallel weight shards it "strided", which
        # is a shard too. Gradients are never partial sums here.
        if mesh is not None and not placement.is_replicate():
            count *= mesh.size(dim)
    return count


def _check_sharding(
    ctx: Context, fsdp: bool | str, tp_plan: Mapping[str, Any] | None
) -> tuple[bool | str, Mapping[str, Any] | None]:
    """``Pipeline(fsdp=..., tp_plan=...)`` checked against the context."""
    if fsdp not in (False, True, "reshard"):
        raise ConfigError(
            f"fsdp must be False, True (gather each stage once per step) or 'reshard' (gather "
            f"each block per use), got {fsdp!r}"
        )
    if fsdp and (not ctx.distributed or ctx.dp_size < 2):
        raise ConfigError(
            "fsdp=True shards over the data-parallel replicas; start them with "
            "conveyor.init(pp=P, dp=D) on P x D processes, D >= 2"
        )
    if tp_plan is not None and (not ctx.distributed or ctx.tp_size < 2):
        raise ConfigError(
            "tp_plan shards layers over tensor-parallel ranks; start them with "
            "conveyor.init(pp=P, tp=T) on P x T processes, T >= 2"
        )
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        raise ConfigError(
            "tp_plan must map module-name patterns to torch ParallelStyles, e.g. "
            "{'blocks.*.mlp.fc1': ColwiseParallel(), 'blocks.*.mlp.fc2': RowwiseParallel()}"
        )
    return fsdp, tp_plan


def _name_of(stage: nn.Module, first: nn.Module, name: str) -> str:
    """The name ``stage`` uses for the parameter ``first`` holds as ``name``."""
    param = dict(first.named_parameters())[name]
    return next(n for n, p in stage.named_parameters() if p is param)


def _check_ties_for_fsdp(
    ties: list[tuple[dict[int, str], list[int]]], placement: tuple[int, ...]
) -> None:
    """FSDP shards each stage on its own: a weight two stages of one rank share would
    become two. Checked over every rank's stages (every rank knows the whole placement),
    so every rank raises the same error instead of only those holding the weight."""
    for names, holders in ties:
        for rank in sorted({placement[s] for s in holders}):
            local = [s for s in holders if placement[s] == rank]
            if len(local) > 1:
                raise ConfigError(
                    f"fsdp cannot shard the weight {names[local[0]]!r}, which stages "
                    f"{local[0]} and {local[1]} of pipeline rank {rank} share (a V schedule "
                    f"with tied weights); use a schedule that places stages in a loop "
                    f"(1f1b, zb-h1, interleaved-1f1b) or untie the weight"
                )


def pipeline_ranks(
    ctx: Context, model: Any, schedule: str | Schedule, chunks: int, balance: list[int] | None
) -> int:
    """Pipeline ranks: the context's, or in a one-process world where init() was not
    given pp, as many as the schedule, balance or annotations describe."""
    if ctx.distributed or ctx.pp_explicit:
        if ctx.distributed and balance is not None and not isinstance(schedule, Schedule):
            _check_balance_fits(ctx, balance, chunks)
        return ctx.pp_size
    if isinstance(schedule, Schedule):
        return schedule.ranks
    stages = len(balance) if balance is not None else annotated_stages(model)
    if stages is None:
        return ctx.pp_size
    if stages % chunks:
        where = "balance" if balance is not None else "the pipeline_stage annotations"
        raise ConfigError(
            f"{where} describe {stages} stages, which {chunks} chunks per rank cannot "
            f"share out; give a multiple of {chunks} stages"
        )
    return stages // chunks


def _check_balance_fits(ctx: Context, balance: list[int], chunks: int) -> None:
    """A balance for another stage count than pp x chunks of a launched run, in words
    that say how many processes it needs (one process runs as many ranks as it says)."""
    if not isinstance(balance, (list, tuple)) or len(balance) == ctx.pp_size * chunks:
        return
    stages, have = len(balance), ctx.pp_size * chunks
    head = (
        f"balance {list(balance)} describes {stages} stages, but this run has {ctx.pp_size} "
        f"pipeline ranks x {chunks} chunk(s) = {have} stages"
    )
    if stages % chunks:
        raise ConfigError(f"{head}; give balance {have} entries, one layer count per stage")
    ranks = stages // chunks
    need = ranks * ctx.dp_size * ctx.tp_size
    mesh = f" x dp {ctx.dp_size} x tp {ctx.tp_size}" if need != ranks else ""
    raise ConfigError(
        f"{head}; launch {need} processes for {ranks} pipeline ranks{mesh} (conveyor launch "
        f"--nproc-per-node {need} script.py), or give balance {have} entries"
    )
