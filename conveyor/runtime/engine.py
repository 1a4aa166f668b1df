"""Runs one step of a :class:`Schedule` on this process's stages and reports it.

What runs when is the :class:`~conveyor.runtime.program.RankProgram` (pure data); how
values move is the :mod:`~conveyor.runtime.channel`; what an action computes is
:class:`~conveyor.runtime.compute.StageCompute`. This module is the loop that walks the
program and returns a :class:`StepRecord`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.context import Context
from conveyor.errors import ConveyorError, PipelineError, one_line
from conveyor.runtime.channel import Mailbox, Remote
from conveyor.runtime.compiled import CompileStats
from conveyor.runtime.compute import StageCompute
from conveyor.runtime.ends import LossFn, ModelEnds, StageEnds, model_loss
from conveyor.runtime.memory import ActivationMeter, MemoryReport, simulated_peak
from conveyor.runtime.microbatch import Header, MicroBatches, header_message
from conveyor.runtime.overlap import Pair, Spans, record
from conveyor.runtime.program import (
    RankProgram,
    Tick,
    producer_of,
    rank_program,
    single_process_program,
)
from conveyor.runtime.step_loss import pack
from conveyor.runtime.step_state import Mode, StepRecord, StepState
from conveyor.runtime.step_sync import StepSync
from conveyor.runtime.timing import Timing
from conveyor.schedules import Action, B, F, Schedule, W

__all__ = ["Engine", "Header", "LossFn", "ModelEnds", "model_loss"]


class Engine:
    """Runs train / eval / predict steps of one schedule over this process's stages."""

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        ends: StageEnds,
        ctx: Context,
        *,
        recompute: frozenset[int] = frozenset(),
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
        compiled: CompileStats | None = None,
        modules: Mapping[int, str] | None = None,
        pairs: bool = False,
    ) -> None:
        """``ends``: what the first stage reads and what the last stage's output becomes
        (:class:`~conveyor.runtime.ends.ModelEnds`: the model's input and ``loss_fn``);
        ``recompute``: global indices of stages whose forward is re-run at B instead of
        keeping its activations; ``autocast``: the dtype stage forwards run under
        ``torch.autocast`` (None: as the model is); ``track_memory``: measure the activation
        memory of every training step; ``compiled``: the stages were compiled
        (:func:`~conveyor.runtime.compiled.compile_stages`); ``modules``: per stage, its
        modules as ``print(pipe)`` names them (an error raised in a stage's work names
        them); ``pairs``: run the schedule's overlapped pairs interleaved at their
        all-to-alls (:mod:`~conveyor.runtime.overlap`; where experts are sharded)."""
        self.schedule = schedule
        self.modules = dict(modules or {})
        self.stages = stages
        self.ctx = ctx
        self.meter = (
            ActivationMeter(p for stage in stages.values() for p in stage.parameters())
            if track_memory
            else None
        )
        self.compute = StageCompute(
            stages,
            schedule.stages - 1,
            schedule.split_backward,
            ends,
            ctx.device,
            recompute=recompute,
            autocast=autocast,
            meter=self.meter,
            compiled=compiled,
        )
        self.ends = ends
        self.channel: Mailbox = (
            Remote(schedule, stages, ctx, self.compute.gradient_metas)
            if ctx.distributed
            else Mailbox(schedule, stages)
        )
        self.pairs = pairs and ctx.distributed and bool(schedule.pairs)
        self._programs: dict[tuple[bool, bool], RankProgram] = {}
        self._stages = schedule.stages  # read every tick
        self._producer: dict[Action, Action | None] = {}  # what each action takes, as asked
        self._state = StepState("train")  # the step in progress (or the last one)
        self._syncs: Sequence[StepSync] = ()
        self._spans = Spans(ctx.pp_rank, 0.0, [])

    def program(self, train: bool, join: bool = False) -> RankProgram:
        """This process's program for a training (``train``) or forward-only step;
        ``join``: with fewer groups, once every value's description is known (program
        rule 4)."""
        program = self._programs.get((train, join))
        if program is None:
            passes = self.ends.forward_passes  # the kinds a forward-only step runs
            if self.ctx.distributed:
                program = rank_program(self.schedule, self.ctx.pp_rank, train, join, self.pairs,
                                       passes)  # fmt: skip
            else:
                program = single_process_program(self.schedule, train, passes)
            self._programs[train, join] = program
        return program

    def header(self, batch: MicroBatches) -> Header:
        """What every pipeline rank learns from the first stage's batch at the step's start
        (one message from its holder to each other rank; :func:`header_message`)."""
        m = self.schedule.microbatches
        message = header_message(batch, m, self.ctx.device)
        return Header.read(self.channel.agree(message, batch.inputs is not None), m)

    def run(
        self,
        mode: Mode,
        batch: MicroBatches,
        header: Header,
        scale: float,
        syncs: Sequence[StepSync] = (),
        aux_weight: float | None = None,
    ) -> StepRecord:
        """Run one step.

        ``batch`` holds this process's micro-batches (inputs where it holds the first
        stage, targets where it holds the last and a ``loss_fn`` reads them); ``header``
        is :meth:`header` of it; ``scale`` multiplies every micro-batch's loss total before
        its backward (:mod:`conveyor.runtime.step_loss`); ``syncs`` run around the actions
        (:class:`~conveyor.runtime.step_sync.StepSync`); ``aux_weight`` weighs a model's
        router auxiliary loss (:func:`~conveyor.runtime.step_loss.router_weight`). Outside
        ``predict`` the record's ``sums`` are the last stage's loss sums, on every pipeline rank.
        """
        train = mode == "train"
        key = (header.signature, mode)
        program = self.program(train, self.channel.knows(key))
        compute, channel = self.compute, self.channel
        t0 = time.perf_counter()  # after the header: ranks start together
        state = StepState(mode, batch.targets, header.sizes, header.counts, scale,
                          program.adjacent, t0, aux_weight)  # fmt: skip
        self._state, self._syncs = state, syncs
        compute.begin(state)
        self.ends.begin(state, batch.inputs, batch.targets)
        channel.begin(key, t0)
        meter = self.meter if train else None
        cuda = self.ctx.device.type == "cuda"
        if meter is not None:
            meter.reset()
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.ctx.device)
        for sync in syncs:
            sync.begin(program)
        self._spans = Spans(self.ctx.pp_rank, t0, state.exchanges)
        record(self._spans)
        try:
            self._walk(program, train, batch.inputs, mode != "predict")
            # The loss sums go before the sends are waited for: the last stage's rank
            # need not wake again to post them (gloo moves them once their receive is up).
            shared = channel.share(pack(state.loss, self.ctx.device)) if mode != "predict" else None
            channel.end()
            for sync in syncs:
                sync.finish()
        except BaseException:
            for sync in syncs:
                sync.abort()
            raise
        finally:
            record(None)
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
        waits = channel.waits + state.exchanges
        return state.record(shared() if shared is not None else None, waits, memory)

    def _walk(
        self, program: RankProgram, train: bool, inputs: list[Any] | None, sums: bool
    ) -> None:
        """Every tick of ``program``, in order; with ``sums``, the loss sums' receive is
        posted right after the last transfers."""
        ticks = program.ticks
        expect = program.last_group if sums else -1
        if expect < 0 and sums:
            self.channel.expect_sums()
        meter = self.meter if train else None
        with (
            torch.set_grad_enabled(train),
            meter.hooks() if meter is not None else contextlib.nullcontext(),
        ):
            for i, j in program.runs:
                action = ticks[i].action
                if action is not None and action.kind == W:
                    self._weight_grads(ticks[i:j])  # W of one stage: a GEMM per weight
                else:
                    self._tick(ticks[i], inputs)
                if i <= expect < j:
                    self.channel.expect_sums()

    def _tick(self, tick: Tick, inputs: list[Any] | None) -> None:
        """One tick: compute its action (if any) and post its group of transfers.

        A tick ``ahead`` posts its receives before the compute, as a group of their own
        (program rules 3 and 7), so they are up before their data arrives: gloo moves a
        message only once its receive is posted, and then receives it in the background.
        """
        if tick.boundary is not None:
            self._pass(tick)
            return
        channel, syncs = self.channel, self._syncs
        if tick.ahead:
            channel.post(tick, sends=False)
        action, paired = tick.action, tick.paired
        if paired is None:
            if action is not None:  # one action: the common tick, without lists
                value = self._input(action, inputs)
                for sync in syncs:
                    sync.before_action(action)
                out = self._compute(tick.rank, action, value)
                if out is not None:
                    channel.deliver(action, out)
        else:
            self._pair_tick(tick, inputs)
        if tick.sends or not tick.ahead:
            channel.post(tick, recvs=not tick.ahead)
        if syncs:
            for done in tick.computed:
                for sync in syncs:
                    sync.after_action(done)

    def _pair_tick(self, tick: Tick, inputs: list[Any] | None) -> None:
        """The compute of a tick of two actions (an overlapped pair of the schedule)."""
        actions = tick.computed
        values = [self._input(a, inputs) for a in actions]
        for action in actions:
            for sync in self._syncs:
                sync.before_action(action)
        if self.meter is None:
            outs = self._pair(tick.rank, actions, values)
        else:
            outs = [self._compute(tick.rank, a, v) for a, v in zip(actions, values, strict=True)]
        for action, out in zip(actions, outs, strict=True):
            if out is not None:
                self.channel.deliver(action, out)

    def _pass(self, tick: Tick) -> None:
        """A pass of the stage ends (every rank runs it at this tick)."""
        assert tick.boundary is not None
        for sync in self._syncs:
            sync.before_pass()
        try:
            self.ends.run_pass(tick.boundary)
        except ConveyorError:
            raise
        except Exception as exc:
            where = f"rank {self.ctx.rank}: " if self.ctx.distributed else ""
            raise PipelineError(
                f"{where}the pass {tick.boundary} raised {one_line(exc)}; its "
                f"traceback, above this one, shows the failing line"
            ) from exc

    def _input(self, action: Action, inputs: list[Any] | None) -> Any:
        """What ``action`` computes on: its micro-batch, or what its producer sent."""
        if action.kind == F and action.stage == 0:
            assert inputs is not None
            return inputs[action.microbatch]
        if action.kind == B and action.stage == self._stages - 1:
            return self.ends.output_grad(action.microbatch)
        producers = self._producer
        if action in producers:
            producer = producers[action]
        else:
            producer = producers[action] = producer_of(action, self._stages)
        return self.channel.take(producer, action) if producer is not None else None

    def _pair(self, rank: int, actions: tuple[Action, ...], values: list[Any]) -> list[Any]:
        """An overlapped pair (F, B), interleaved at their all-to-alls. Each is timed by
        the compute it did, the F from the pair's start and the B after it, so the busy
        time is the compute and the rest (both waiting on transfers) is idle."""
        f, b = actions  # (with track_memory a pair runs one by one: each action's bytes)
        pair = Pair(f, b, self.ctx.device)
        state = self._state
        start = time.perf_counter()
        out_f, out_b = pair.run(
            lambda: self._compute(rank, f, values[0], timed=False),
            lambda: self._compute(rank, b, values[1], timed=False),
        )
        begin = start - state.t0
        middle = begin + pair.compute[0]
        for action, lo, hi in ((f, begin, middle), (b, middle, middle + pair.compute[1])):
            state.timings.append(Timing(rank, action.kind, action.stage, action.microbatch, lo, hi))
        return [out_f, out_b]

    def _compute(self, rank: int, action: Action, value: Any, timed: bool = True) -> Any:
        """F or B of ``action``, timed unless not ``timed`` (and its memory measured with
        ``track_memory``)."""
        compute, state = self.compute, self._state
        meter = self.meter if state.train else None
        key = (action.stage, action.microbatch)
        self._spans.action = action  # names the all-to-alls outside a pair
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
        if timed:
            end = time.perf_counter()
            state.timings.append(Timing(rank, action.kind, *key, start - state.t0, end - state.t0))
        return out

    def _weight_grads(self, ticks: Sequence[Tick]) -> None:
        """A run of W of one stage, computed together; each W is timed as an equal share.
        W sends nothing, so the run's groups (receives only) are posted first."""
        for tick in ticks:
            self.channel.post(tick)
        fused = [t.action for t in ticks if t.action is not None]
        for sync in self._syncs:
            sync.before_action(fused[0])
        start = time.perf_counter()
        microbatches = [a.microbatch for a in fused]
        try:
            self.compute.weight_grads(fused[0].stage, microbatches)
        except ConveyorError:
            raise
        except Exception as exc:
            raise self._failed(fused[0], microbatches, exc) from exc
        share = (time.perf_counter() - start) / len(fused)
        state = self._state
        for k, a in enumerate(fused):
            begin = start - state.t0 + k * share
            state.timings.append(
                Timing(ticks[0].rank, W, a.stage, a.microbatch, begin, begin + share)
            )
            for sync in self._syncs:
                sync.after_action(a)

    def _failed(self, action: Action, microbatches: list[int], error: Exception) -> PipelineError:
        """The error a stage's F, B or W raised, in one sentence naming the rank, the work,
        the stage with its modules and the micro-batch(es); raised ``from`` the original."""
        s = action.stage
        if action.kind == F:
            last = s == self.schedule.stages - 1 and self._state.mode != "predict"
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
