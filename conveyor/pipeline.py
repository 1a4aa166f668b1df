"""``Pipeline``, the object users touch: it runs steps and holds module-like state.

What it runs is built by :mod:`conveyor._build` from options checked by
:mod:`conveyor._options`; clipping lives in :mod:`conveyor.runtime.clipping`, measurement
in :mod:`conveyor.observe.measure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import conveyor._failure as failure
from conveyor._build import RankParts, build_over, held_stages, shared_sample
from conveyor._options import Options, check_step_arguments, schedule_chunks
from conveyor._setup import Settled, settle
from conveyor.context import Context, current
from conveyor.module_state import ModuleState
from conveyor.observe.last_step import LastStep
from conveyor.partition.capture import NeedsSample, not_split_yet
from conveyor.partition.describe import SplitInfo
from conveyor.planning.planner import Plan
from conveyor.runtime import microbatch
from conveyor.runtime.clipping import clip_grad_norm
from conveyor.runtime.compiled import CompileStats
from conveyor.runtime.compute import LossFn
from conveyor.runtime.step import StepOutput
from conveyor.runtime.step_state import Mode, StepRecord
from conveyor.schedules import Schedule
from conveyor.weights import Weights


class Pipeline(LastStep, ModuleState):
    """A model cut into stages and trained by a pipeline schedule.

    Build it the same way on every rank; ``train_step`` leaves in each local parameter's
    ``.grad`` the gradient the unsplit model would have; step an optimizer built over
    ``pipe.parameters()`` (or the model's), before or after the first step. With
    ``conveyor.init(pp=P, dp=D)`` each replica passes its own shard of the global batch
    (``ctx.dp_rank`` / ``ctx.dp_size``; sizes may differ).

    Args:
        model: the whole model, built the same on every rank. A layer list or
            ``nn.Sequential`` is cut into contiguous stages; any other model is captured as
            a graph (``torch.fx``, or ``torch.export`` on ``sample`` or the first batch).
        loss_fn: ``(output, target) -> scalar``, the mean over a micro-batch's rows, or
            ``-> (total, count)``, its summed loss and the items summed (e.g.
            :class:`conveyor.losses.TokenCrossEntropy`): the step's loss is then
            ``sum(total) / sum(count)`` over the whole batch. None when the model computes
            its own loss (e.g. a transformers model given ``labels``; a language model's
            token loss is then weighted by the tokens of each micro-batch, as one call on
            the whole batch averages them).
        microbatches: micro-batches per step (>= 1).
        schedule: a schedule name (``gpipe``, ``1f1b``, ``interleaved-1f1b``,
            ``looped-bfs``, ``zb-h1``, ``zb-h2``, ``zb-late``, ``zb-auto``, ``zbv``,
            ``dualpipev``, ``v-half``, ``v-min``), ``"auto"`` (the planner picks schedule,
            chunks and balance, keeping ``microbatches``; the result is ``pipe.plan``;
            collective), or a :class:`~conveyor.schedules.Schedule`.
        chunks: stages per rank (interleaved and V schedules); None: the schedule's own
            count (2 for ``interleaved-1f1b``, ``looped-bfs`` and the V schedules, else 1).
        balance: layers per stage, e.g. ``[3, 2, 3]``; None: the model's
            ``pipeline_stage`` annotations, else balanced automatically.
        context: the processes to run on; default :func:`conveyor.init`'s.
        fsdp: shard parameters, gradients and optimizer state over the data-parallel
            replicas with torch FSDP2: True gathers each stage once per step,
            ``"reshard"`` each block per use.
        tp_plan: ``{module-name pattern: ParallelStyle}``, sharding those modules over the
            tensor-parallel ranks (DTensor); ``"auto"``: a transformers model's own plan.
        sample: ``(inputs, targets)`` to capture a model ``torch.fx`` cannot trace at
            construction (else on the first batch), and for ``schedule="auto"``.
        memory_limit: for ``schedule="auto"``: the most bytes a pipeline rank may need
            for its stages' parameters, their gradients, AdamW's states and the
            activations the schedule holds at once (docs/guide/planner.md).
        recompute: True (every stage) or global stage indices whose forward is re-run at B
            (under F's RNG state, so dropout repeats its masks) instead of keeping its
            activations.
        autocast: ``torch.bfloat16`` or ``torch.float16``: stage forwards and the loss run
            under ``torch.autocast``; parameters and gradients keep their dtype.
        track_memory: measure each training step's activation memory
            (:meth:`last_step_memory`; a Python call per tensor autograd saves).
        compile: True or a dict of :func:`torch.compile` keywords: each rank's stages run
            compiled, per block where the split has blocks, whole for a captured graph,
            on every schedule (docs/guide/compile.md).
        weights: where this rank's parameters come from: None keeps real ones and
            initializes meta ones (a model built under :func:`conveyor.empty_weights`:
            each module's own ``reset_parameters`` / transformers ``_init_weights``); a
            conveyor checkpoint or a transformers checkpoint directory (safetensors) loads
            them, each rank reading only its own tensors.
        init_seed: seeds that initialization per module name, so every layout (and
            :func:`conveyor.materialize` of the unsplit model) draws the same weights.
        ep_plan: with ``conveyor.init(ep=E)``, the expert collections to shard over the
            expert-parallel ranks, as module-name patterns (e.g.
            ``["model.layers.*.mlp.experts"]``); None: every experts module of the model
            (transformers' experts interface). Each rank holds ``num_experts / E`` experts
            of each, under the original names (docs/guide/moe.md).
        vocab_parallel: True, a module name or a pair (input embedding, output layer):
            split both vocabulary layers by rows over every pipeline rank and compute the
            token cross-entropy from the shards (``loss_fn`` a
            :class:`~conveyor.losses.TokenCrossEntropy`, or None for a transformers causal
            LM); the passes run inside the schedule (docs/guide/vocab.md).
        cp_attention: with ``conveyor.init(cp=C)``, how attention reaches the keys and
            values of the whole sequence: ``"ring"`` (passed round the cp ranks, each
            transfer beside a block's compute) or ``"all-gather"`` (gathered once per
            attention call, their gradients reduce-scattered once; Llama 3's choice)
            (docs/guide/context-parallel.md).

    Raises:
        ConfigError: an option that cannot work, in one sentence that says what to do.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn | None,
        microbatches: int,
        schedule: str | Schedule = "1f1b",
        chunks: int | None = None,
        balance: list[int] | None = None,
        context: Context | None = None,
        fsdp: bool | str = False,
        tp_plan: Mapping[str, Any] | str | None = None,
        sample: tuple[Any, Any] | None = None,
        memory_limit: float | None = None,
        recompute: bool | Iterable[int] = False,
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
        compile: bool | dict[str, Any] = False,
        weights: Weights = None,
        init_seed: int = 0,
        ep_plan: Sequence[str] | None = None,
        vocab_parallel: bool | str | Sequence[str] = False,
        cp_attention: str = "ring",
    ) -> None:
        self.context = ctx = context if context is not None else current()
        options = Options(
            loss_fn=loss_fn, microbatches=microbatches, chunks=schedule_chunks(schedule, chunks),
            balance=balance, fsdp=fsdp, tp_plan=tp_plan, sample=sample, recompute=recompute,
            autocast=autocast, track_memory=track_memory, compile=compile, weights=weights,
            init_seed=init_seed, ep_plan=ep_plan, vocab_parallel=vocab_parallel,
            cp_attention=cp_attention,
        )  # fmt: skip
        settled = settle(model, ctx, schedule, options, memory_limit)
        self._settled: Settled | None = settled  # until the split, what it starts from
        self.plan: Plan | None = settled.plan
        self.schedule = settled.schedule
        self.options: Options = dataclasses.replace(settled.options, sample=None)  # planner's
        self._model = model
        self._parts: RankParts | None = None
        self._last_train: StepRecord | None = None  # what traces and measurements show
        first = None if sample is None else microbatch.first(sample[0], microbatches)
        # A model fx cannot trace is captured with torch.export on the first batch.
        with contextlib.suppress(NeedsSample):
            self._build(settled.options, first)

    def _build(self, options: Options, sample: Any) -> RankParts:
        """Split the model (on ``sample`` where it is captured with torch.export)."""
        assert self._settled is not None
        parts = build_over(self._model, self.schedule, options, self.context, sample,
                           self._settled.before, self._settled.originals)  # fmt: skip
        self._parts, self._settled = parts, None
        return parts

    @property
    def model(self) -> nn.Module:
        """The model it was built from: its modules as given (the stages run copies), with
        this rank's parameters; others' stay as given (meta under ``empty_weights()``)."""
        return self._model

    @property
    def loss_fn(self) -> LossFn | None:
        """The loss function the pipeline was built with (None: the model's own loss)."""
        return self.options.loss_fn

    @property
    def microbatches(self) -> int:
        """Micro-batches per step."""
        return self.schedule.microbatches

    def _split(self, what: str) -> RankParts:
        """This rank's parts; before a split made on the first batch, an error that says so."""
        if self._parts is None:
            raise not_split_yet(what, self._model)
        return self._parts

    # ------------------------------------------------------------------ the split
    def describe(self) -> SplitInfo:
        """The split (a :class:`~conveyor.partition.describe.SplitInfo`, which ``print(pipe)``
        shows): per stage its rank, modules, parameter count, tied weights, values sent."""
        parts = self._split("pipe.describe()")
        return parts.description.with_shapes(parts.stepper.engine.compute.sent_shapes)

    def __repr__(self) -> str:
        sched = self.schedule
        where = "" if self.context.distributed else ", in one process"
        head = (
            f"Pipeline({sched.name}, {sched.ranks} ranks x {sched.chunks} chunks = "
            f"{sched.stages} stages, {sched.microbatches} micro-batches{where})"
        )
        if self._parts is None:
            return head + "\nnot split yet: the model is captured on the first batch"
        notes = self._parts.ends.note(self.schedule) + self._parts.compile_note()
        return head + "\n" + str(self.describe()) + notes

    @property
    def compile_stats(self) -> CompileStats | None:
        """Compiled stages' graphs and compile time on this rank (None: eager stages)."""
        return self._parts.compiled if self._parts is not None else None

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order."""
        parts = self._split("pipe.stages")
        return [parts.stages[s] for s in sorted(parts.stages)]

    @property
    def vocab_layers(self) -> nn.Module | None:
        """With ``vocab_parallel``: a module holding this rank's rows of the vocabulary
        layers under their names in the model (None without)."""
        return self._split("pipe.vocab_layers").ends.holder

    @property
    def held_stages(self) -> tuple[int, ...]:
        """The global indices of :attr:`stages` (all stages in a one-process world)."""
        return held_stages(self.schedule, self.context)

    def tied_copies(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """``(parameter, ranks holding a copy)`` per copy here of a weight tied across
        ranks, in the same global order on every rank (so the k-th copies match)."""
        return self._split("pipe.tied_copies()").shared.links()

    # ------------------------------------------------------------------ steps
    def _step(
        self, mode: Mode, inputs: Any, targets: Any, cut: Any = None, count: float | None = None
    ) -> StepOutput:
        """A step of ``mode``, after checking its arguments and, on the first batch of a
        model captured on it, splitting the model. An error here stops every rank
        (:class:`~conveyor._failure.Step`)."""
        with failure.Step():
            sample = check_step_arguments(mode, self.loss_fn, inputs, targets, cut)
            parts = self._parts
            if parts is None:
                sample = shared_sample(self.context, self.schedule, self.microbatches, sample)
                parts = self._build(self.options, sample)
            parts.modes.follow()  # the stages' copies of modules in the model's modes
            step = parts.stepper.run(mode, inputs, targets, cut, count)
        if mode == "train":
            self._last_train = step.record
        return step

    def train_step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        microbatches: Sequence[tuple[Any, Any]] | None = None,
        count: float | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch.

        The loss is the whole (global) batch's: a scalar ``loss_fn`` result is a mean over
        its micro-batch's rows, weighted by them; a pair ``(total, count)`` makes the loss
        ``sum(total) / sum(count)`` over every micro-batch and replica (see
        :mod:`conveyor.losses`).

        Args:
            inputs: a tensor, or a tuple (positional) / dict (keyword) of tensors, divided
                on dim 0 into ``microbatches`` parts; None on ranks without the first stage.
            targets: the same for ``loss_fn``'s targets; None with ``loss_fn=None`` and on
                ranks without the last stage.
            microbatches: instead of ``inputs`` / ``targets``: ``[(inputs_0, targets_0),
                ...]``, exactly the pipeline's ``microbatches`` of them, cut by you (each
                with its own shapes, e.g. bucketed by length); the same list on every rank.
            count: divide the summed loss by this instead of the summed count (or rows):
                e.g. the tokens of every batch one optimizer step accumulates, over all
                replicas. The same on every rank.

        Returns:
            The batch loss (detached, float32), the same on every rank; with data
            parallelism the global batch's. Its gradient is added to each local
            parameter's ``.grad``, like ``loss.backward()``.

        Raises:
            ConfigError: bad inputs, or a batch with nothing to average over, in one
                sentence.
            PipelineError: a stage failed, or another rank died or stalled (named).
        """
        combined = self._step("train", inputs, targets, microbatches, count).combined
        assert combined is not None
        return combined.loss

    @torch.no_grad()
    def eval_step(
        self, inputs: Any = None, targets: Any = None, *,
        microbatches: Sequence[tuple[Any, Any]] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The batch loss without gradients.

        Args:
            inputs: as for :meth:`train_step`.
            targets: as for :meth:`train_step`.
            microbatches: as for :meth:`train_step`.

        Returns:
            The loss on every rank (the global batch's), combined as :meth:`train_step` does."""
        combined = self._step("eval", inputs, targets, microbatches).combined
        assert combined is not None
        return combined.loss

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The model's output for a batch, without gradients.

        Args:
            inputs: as for :meth:`train_step` (None on ranks without the first stage).

        Returns:
            The whole batch's output on the rank holding the last stage, None elsewhere."""
        outputs = self._step("predict", inputs, None).record.outputs
        return microbatch.merge(outputs) if outputs else None

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradients like :func:`torch.nn.utils.clip_grad_norm_`.

        The total norm covers every stage on every rank, each parameter once (a tied
        weight with copies on several ranks; data-parallel replicas; FSDP and
        tensor-parallel shards). Every local gradient is scaled by
        ``min(1, max_norm / (total + 1e-6))``. A collective in a distributed world: call it
        on every rank.

        Args:
            max_norm: the largest norm left.
            norm_type: any p > 0, or ``inf``.

        Returns:
            The total norm before clipping (float32), the same on every rank.

        Raises:
            ConfigError: ``norm_type`` is not > 0.
        """
        parts = self._split("pipe.clip_grad_norm_()")
        copies = parts.shared.copies()  # tied copies counted on another rank
        return clip_grad_norm(self.parameters(), copies, self.context, max_norm, norm_type)
