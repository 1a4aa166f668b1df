"""Runs one step of a :class:`Schedule` on this process's stages and reports it.

What runs when is the :class:`~conveyor.runtime.program.RankProgram` (pure data); how
values move is the :mod:`~conveyor.runtime.channel`; what an action computes is
:class:`~conveyor.runtime.compute.StageCompute`. This module is the loop that walks the
program and returns a :class:`StepRecord`.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.context import Context
from conveyor.errors import ConveyorError, PipelineError, one_line
from conveyor.runtime.channel import Mailbox, Remote
from conveyor.runtime.compute import LossFn, StageCompute, model_loss
from conveyor.runtime.memory import ActivationMeter, MemoryReport, simulated_peak
from conveyor.runtime.microbatch import MicroBatches
from conveyor.runtime.program import (
    RankProgram,
    Tick,
    producer_of,
    rank_program,
    single_process_program,
)
from conveyor.runtime.sharding import Sharded
from conveyor.runtime.step_loss import loss_scale
from conveyor.runtime.step_state import Mode, StepRecord, StepState
from conveyor.runtime.timing import Timing
from conveyor.schedules import Action, F, Schedule, W

__all__ = ["Engine", "LossFn", "model_loss"]


class Engine:
    """Runs train / eval / predict steps of one schedule over this process's stages."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        loss_fn: LossFn | None,
        ctx: Context,
        *,
        recompute: frozenset[int] = frozenset(),
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
        sharded: Sharded | None = None,
        on_action: Callable[[Action], None] | None = None,
        modules: Mapping[int, str] | None = None,
    ) -> None:
        """``recompute``: global indices of stages whose forward is re-run at B instead of
        keeping its activations; ``autocast``: the dtype stage forwards run under
        ``torch.autocast`` (None: as the model is); ``track_memory``: measure the activation
        memory of every training step; ``sharded``: FSDP on these stages, gathered before
        each stage's first action of a step and reduced after its last; ``on_action``:
        called after each action (data parallelism starts reducing a stage's gradients
        after its last B / W); ``modules``: per stage, its modules as ``print(pipe)``
        names them (an error raised in a stage's work names them)."""
        self.schedule = schedule
        self.modules = dict(modules or {})
        self.stages = stages
        self.ctx = ctx
        self.sharded = sharded
        self.on_action = on_action
        self.meter = (
            ActivationMeter(p for stage in stages.values() for p in stage.parameters())
            if track_memory
            else None
        )
        self.compute = StageCompute(
            stages,
            schedule.stages - 1,
            schedule.split_backward,
            loss_fn,
            ctx.device,
            recompute=recompute,
            autocast=autocast,
            meter=self.meter,
        )
        self.channel: Mailbox = (
            Remote(schedule, stages, ctx, self.compute.gradient_metas)
            if ctx.distributed
            else Mailbox(schedule, stages)
        )
        self._programs: dict[bool, RankProgram] = {}
        self._stages = schedule.stages  # read every tick

    def program(self, train: bool) -> RankProgram:
        """This process's program for a training (``train``) or forward-only step."""
        program = self._programs.get(train)
        if program is None:
            if self.ctx.distributed:
                program = rank_program(self.schedule, self.ctx.pp_rank, train)
            else:
                program = single_process_program(self.schedule, train)
            self._programs[train] = program
        return program

    def run(self, mode: Mode, batch: MicroBatches, scale: float | None = None) -> StepRecord:
        """Run one step.

        ``batch`` holds this process's micro-batches (inputs where it holds the first
        stage, targets where it holds the last and a ``loss_fn`` reads them). ``scale``
        multiplies every micro-batch's loss total before its backward (None: one over the
        batch's rows; see :mod:`conveyor.runtime.step_loss`).
        """
        train = mode == "train"
        program = self.program(train)
        signature, sizes, counts = self._signature(batch)
        if scale is None:
            scale = loss_scale(sum(sizes))
        compute, channel = self.compute, self.channel
        t0 = time.perf_counter()  # after the signature broadcast: ranks start together
        state = StepState(mode, batch.targets, sizes, counts, scale, program.adjacent, t0)
        compute.begin(state)
        channel.begin((signature, mode), t0)
        meter = self.meter if train else None
        cuda = self.ctx.device.type == "cuda"
        if meter is not None:
            meter.reset()
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.ctx.device)
        sharded = self.sharded
        if sharded is not None:
            sharded.begin(sorted(program.first, key=program.first.__getitem__))
        ticks = program.ticks
        with (
            torch.set_grad_enabled(train),
            meter.hooks() if meter is not None else contextlib.nullcontext(),
        ):
            i = 0
            while i < len(ticks):
                action = ticks[i].action
                if action is not None and sharded is not None and program.first[action.stage] == i:
                    sharded.ready(action.stage)
                    compute.gathered(action.stage)
                if action is not None and action.kind == W:
                    # Consecutive W of one stage run as one: a GEMM per weight, not per W.
                    j = i + 1
                    while j < len(ticks) and _is_weight_of(ticks[j].action, action.stage):
                        j += 1
                    self._weight_grads(ticks[i:j])
                else:
                    j = i + 1
                    self._tick(ticks[i], batch.inputs)
                if action is not None and sharded is not None and program.final[action.stage] < j:
                    sharded.finish(action.stage, train)
                i = j
        channel.end()
        memory = None
        if meter is not None:
            forward, backward = state.forward_bytes, state.backward_bytes
            peak = simulated_peak(program.actions, self.schedule.split_backward, forward, backward)
            device_peak = torch.cuda.max_memory_allocated(self.ctx.device) if cuda else None
            memory = MemoryReport(meter.peak, forward, backward, peak, device_peak)
        left = compute.leftovers()
        if left:
            names = ", ".join(f"stage {s} micro-batch {m}" for s, m in left)
            raise PipelineError(
                f"rank {self.ctx.pp_rank}: activations never consumed by a backward: {names}"
            )
        return state.record(channel.waits, memory, compute.sent_shapes)

    def _tick(self, tick: Tick, inputs: list[Any] | None) -> None:
        """One tick: compute its action (if any) and post its group of transfers.

        A group without sends holds only receives: it is posted before the compute, so
        they are up before their data arrives (gloo then receives it in the background).
        The order of groups, which is what NCCL's rules constrain, is the same either way.
        """
        channel, action = self.channel, tick.action
        early = not tick.sends
        if early:
            channel.post(tick)
        if action is not None:
            producer = producer_of(action, self._stages)
            value = channel.take(producer, action) if producer is not None else None
            if action.kind == F and action.stage == 0:
                assert inputs is not None
                value = inputs[action.microbatch]
            out = self._compute(tick.rank, action, value)
            if out is not None:
                channel.deliver(action, out)
        if not early:
            channel.post(tick)
        if action is not None and self.on_action is not None:
            self.on_action(action)

    def _compute(self, rank: int, action: Action, value: Any) -> Any:
        """F or B of ``action``, timed (and its memory measured with ``track_memory``)."""
        compute = self.compute
        state = compute.step
        meter = self.meter if state.train else None
        key = (action.stage, action.microbatch)
        start = time.perf_counter()  # after any wait for the inputs
        try:
            if action.kind == F:
                before = meter.taken if meter is not None else 0
                out = compute.forward(action, value)
                if meter is not None:
                    state.forward_bytes[key] = meter.taken - before
            else:
                before = meter.current if meter is not None else 0
                out = compute.backward(action, value)
                if meter is not None and self.schedule.split_backward:
                    state.backward_bytes[key] = meter.current - before
        except ConveyorError:
            raise  # already says what went wrong, in conveyor's words
        except Exception as exc:
            raise self._failed(action, [action.microbatch], exc) from exc
        end = time.perf_counter()
        state.timings.append(Timing(rank, action.kind, *key, start - state.t0, end - state.t0))
        return out

    def _weight_grads(self, ticks: Sequence[Tick]) -> None:
        """A run of W of one stage, computed together; each W is timed as an equal share.
        W sends nothing, so the run's groups (receives only) are posted first."""
        for tick in ticks:
            self.channel.post(tick)
        fused = [t.action for t in ticks if t.action is not None]
        start = time.perf_counter()
        microbatches = [a.microbatch for a in fused]
        try:
            self.compute.weight_grads(fused[0].stage, microbatches)
        except ConveyorError:
            raise
        except Exception as exc:
            raise self._failed(fused[0], microbatches, exc) from exc
        share = (time.perf_counter() - start) / len(fused)
        for k, a in enumerate(fused):
            begin = start - self.compute.step.t0 + k * share
            self.compute.step.timings.append(
                Timing(ticks[0].rank, W, a.stage, a.microbatch, begin, begin + share)
            )
            if self.on_action is not None:
                self.on_action(a)

    def _failed(self, action: Action, microbatches: list[int], error: Exception) -> PipelineError:
        """The error a stage's F, B or W raised, in one sentence naming the rank, the work,
        the stage with its modules and the micro-batch(es); raised ``from`` the original."""
        s = action.stage
        if action.kind == F:
            last = s == self.schedule.stages - 1 and self.compute.step.mode != "predict"
            work = "forward (with the loss)" if last else "forward"
        elif action.kind == W:
            work = "weight-gradient backward (W)"
        elif self.compute.reruns(s, action.microbatch):
            work = "recomputed forward (at its backward)"
        else:
            work = "input-gradient backward (B)" if self.schedule.split_backward else "backward"
        modules = self.modules.get(s)
        named = f" (modules {modules})" if modules else ""
        which = ", ".join(map(str, microbatches))
        batches = f"micro-batch{'es' if len(microbatches) > 1 else ''} {which}"
        where = f"rank {self.ctx.rank}: " if self.ctx.distributed else ""
        return PipelineError(
            f"{where}the {work} of stage {s}{named} on {batches} raised {one_line(error)}; "
            f"its traceback, above this one, shows the failing line"
        )

    def _signature(
        self, batch: MicroBatches
    ) -> tuple[int, tuple[int, ...], tuple[int, ...] | None]:
        """What every pipeline rank learns from the first stage's batch at step start, in
        one broadcast: a number that changes when micro-batch input shapes change, the
        micro-batches' rows (a scalar loss is weighted by them), and the counts of a
        model's own token loss (:attr:`MicroBatches.counts`)."""
        m = self.schedule.microbatches
        signature = 0
        if batch.inputs is not None:
            shapes = [
                (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                for mb in batch.inputs
                for x in ((mb,) if isinstance(mb, torch.Tensor) else pytree.tree_leaves(mb))
            ]
            signature = zlib.crc32(repr(shapes).encode())
        sizes = batch.sizes if batch.sizes is not None else (0,) * m
        has_counts = batch.counts is not None
        head = torch.tensor([signature, *sizes, int(has_counts)], dtype=torch.int64)
        counts = (
            batch.counts.to(torch.int64)
            if batch.counts is not None
            else torch.zeros(m, dtype=torch.int64, device=self.ctx.device)
        )
        header = torch.cat([head.to(self.ctx.device), counts.to(self.ctx.device)])
        values = self.channel.agree(header, batch.inputs is not None)
        agreed = tuple(values[1 : m + 1])
        return values[0], agreed, tuple(values[m + 2 :]) if values[m + 1] else None


def _is_weight_of(action: Action | None, stage: int) -> bool:
    return action is not None and action.kind == W and action.stage == stage
